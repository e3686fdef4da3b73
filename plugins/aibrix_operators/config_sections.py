"""The ``airflow.cfg`` sections this package reads (``AIRFLOW__<SECTION>__<KEY>`` in the env)."""

BATCH = "aibrix_batch"  # allow-lists, driver pods, the Batch API, dispatch retries
SCALING = "aibrix_scaling"  # serving roles (settings/role_scaling.py)
DROPZONE = "aibrix_dropzone"  # the S3 drop zone (settings/dropzone.py)
