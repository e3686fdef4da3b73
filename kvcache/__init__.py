"""A pipelined, layer-wise KV-cache offloading connector for vLLM.

``kvcache.connector.KVCacheConnector`` is what vLLM loads; the rest is plain modules:
``keys`` (content addressing), ``tiers`` (L1 CPU pool, L2 filesystem/Redis), ``scheduler``
and ``worker`` (the two halves; the worker keeps bookkeeping, with ``l1_cache`` and
``failed_loads``, and moves bytes through ``transfer_jobs`` on a ``transfer_engine``),
``metadata`` (what passes between them), ``transfer`` (paged-cache copies), ``codec``
(self-checking records), ``metrics`` and ``config``.
The connector module is not imported here so that the storage modules work without vLLM.
"""
