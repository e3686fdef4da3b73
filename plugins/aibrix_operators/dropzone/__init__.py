"""The S3 drop zone: a JSONL file landing under an inbox prefix starts a ``batch_inference`` run.

``core`` (no Airflow): which inbox objects are new, claiming each (name, content) once. The
Airflow side lives with its kind: ``settings/dropzone.py`` (``[aibrix_dropzone]``),
``triggers/dropzone.py`` (the deferrable wait), ``operators/dropzone.py`` (the tasks of
``dags/s3_dropzone.py``).
Design and decisions: docs/dropzone.md.
"""
