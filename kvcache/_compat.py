"""vLLM base classes, with stand-ins where vLLM is absent.

The worker path (kvcache.worker) must also run under plain PyTorch (bench/gpu_kvcache.py
on a GPU machine without vLLM); only the connector facade needs vLLM itself.
"""

from __future__ import annotations

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # pragma: no cover - exercised only without vLLM installed

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        pass


__all__ = ["KVConnectorMetadata", "KVConnectorWorkerMetadata"]
