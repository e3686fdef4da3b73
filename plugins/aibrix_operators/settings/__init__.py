"""The deployment's settings, read from Airflow's config (``[aibrix_batch]``, ``[aibrix_scaling]``;
``config_sections.py``) and connections: the allow-lists (``trust.py``), driver pods
(``driver_pods.py``), the serving roles (``role_scaling.py``). Readers, not hooks: nothing here
holds a connection open; ``hooks/`` has the hooks.
"""
