"""The OpenAI-compatible Batch API (``/openai/v1``): files, batches, cancel, tenants.

Core modules here import no FastAPI and (except ``airflow_runs``) no Airflow:
ids and names (``ids``), API keys (``auth``), settings (``settings``), the file
store (``files``), batch creation rules (``batches``), run state → Batch object
(``status``), OpenAI error bodies (``errors``). ``app`` is the thin FastAPI layer
and ``plugins/batch_api_plugin.py`` mounts it in the Airflow api-server.
"""
