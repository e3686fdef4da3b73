"""Role-specific scaling of the serving roles (prefill, decode) against a batch's deadline.

``policy`` is pure (no Airflow, no I/O): inputs in, a ``ScaleDecision`` per role out.
``kube`` talks to the Kubernetes API (scale subresource or StormService role replicas);
``progress`` reads the drivers' progress from the shards' result logs. The Airflow
sensors and triggers that use them live in ``aibrix_operators.sensors`` / ``.triggers``.
"""
