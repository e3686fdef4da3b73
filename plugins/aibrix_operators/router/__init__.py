"""The P/D router: an OpenAI-compatible front for prefill and decode vLLM instances.

Core code, no Airflow: the router image installs only aiohttp, orjson and prometheus-client.
``app.build_app`` is the aiohttp application; ``python -m aibrix_operators.router`` runs it.
"""
