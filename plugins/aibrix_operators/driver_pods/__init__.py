"""Driver pods for ``execution_mode=kubernetes``: the pod spec and the meaning of its end (no Airflow)."""
