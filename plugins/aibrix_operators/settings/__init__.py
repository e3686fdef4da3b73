"""The deployment's settings, read from Airflow's config (``[aibrix_batch]``, ``[aibrix_scaling]``;
``config_sections.py``) and connections: where batch data goes (``locations.py``), driver pods
(``driver_pods.py``), the serving roles (``role_scaling.py``). Readers, not hooks: nothing here
holds a connection open; ``hooks/`` has the hooks. The allow-lists are the trust room's
(``trust/deployment.py``).
"""
