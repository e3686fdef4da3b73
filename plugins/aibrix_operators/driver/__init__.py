"""The batch driver: sends one shard's requests to an OpenAI-compatible server.

No Airflow imports: it runs inside an Airflow worker (local mode) and inside the
slim driver pod (Kubernetes mode) alike.
"""

from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.driver.shard_outcome import ShardOutcome

__all__ = ["DriverConfig", "ShardOutcome", "run_shard"]
