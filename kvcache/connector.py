"""``KVCacheConnector``: the class vLLM loads. A thin facade over the two halves.

    --kv-transfer-config '{"kv_connector": "KVCacheConnector",
                           "kv_connector_module_path": "kvcache.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {...see kvcache.config...}}'

Scheduler-side hooks delegate to ``KVCacheScheduler``; worker-side hooks to
``KVCacheWorker``; they talk only through ``KVCacheStepMetadata`` / ``KVCacheWorkerReport``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.core.sched.output import SchedulerOutput

from kvcache import metrics
from kvcache.adapters import AdapterUnavailable, adapter_identity, first_warning
from kvcache.config import KVCacheSettings
from kvcache.fingerprint import weights_fingerprint
from kvcache.handoff import Handoff
from kvcache.keys import KeyNamespace, layer_number
from kvcache.metadata import KVCacheStepMetadata, KVCacheWorkerReport
from kvcache.scheduler import KVCacheScheduler
from kvcache.tiers import make_l2
from kvcache.worker import KVCacheWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under "vllm." so that records reach the handlers vLLM configures in its processes.
log = logging.getLogger(f"vllm.{__name__}")


def build_namespace(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: KVCacheSettings
) -> KeyNamespace:
    """The key namespace, computed identically by both halves (and by other instances)."""
    from vllm.platforms import current_platform

    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    block_size = vllm_config.cache_config.block_size
    layout = f"{current_platform.device_type}/{kv_cache_config.kv_cache_layout}/{type(spec).__name__}"
    model = vllm_config.model_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    return KeyNamespace(
        model=f"{model.model}@{model.revision or ''}",
        dtype=str(model.dtype),
        kv_cache_dtype=f"{cache_dtype}/{getattr(spec, 'dtype', '')}",
        weights=settings.model_fingerprint or weights_fingerprint(model.model),
        block_size=block_size,
        chunk_tokens=settings.chunk_size(block_size),
        num_layers=sum(len(g.layer_names) for g in kv_cache_config.kv_cache_groups),
        kv_heads=getattr(spec, "num_kv_heads", 0),
        head_size=getattr(spec, "head_size", 0),
        kv_layout=layout,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        extra=settings.namespace,
    )


def _layer_ids(kv_cache_config: KVCacheConfig) -> list[int] | None:
    """Global layer numbers of the layers in this config (the worker keys by them)."""
    names = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
    nums = [layer_number(n) for n in names]
    if any(n is None for n in nums) or len(set(nums)) != len(nums):
        return None
    return sorted(n for n in nums if n is not None)


class KVCacheConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = KVCacheSettings.from_extra(tc.kv_connector_extra_config)
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("KVCacheConnector supports models with one KV cache group")
        namespace = build_namespace(vllm_config, kv_cache_config, self.settings)
        self.block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks
        can_load = tc.kv_role in ("kv_consumer", "kv_both")
        can_save = tc.kv_role in ("kv_producer", "kv_both")
        self.scheduler: KVCacheScheduler | None = None
        self.worker: KVCacheWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if tc.kv_load_failure_policy != "recompute":
                # A failed or corrupt load must mean recompute, never a failed request.
                log.warning(
                    "kvcache: setting kv_load_failure_policy=recompute (was %s)", tc.kv_load_failure_policy
                )
                tc.kv_load_failure_policy = "recompute"
            self.scheduler = KVCacheScheduler(
                self.settings,
                namespace,
                self.block_size,
                make_l2(self.settings),
                can_load=can_load,
                can_save=can_save,
                layer_ids=_layer_ids(kv_cache_config),
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker = KVCacheWorker(
                self.settings, namespace.prefix(), get_tensor_model_parallel_rank(), make_l2(self.settings)
            )
            if self.settings.metrics_port and get_tensor_model_parallel_rank() == 0:
                metrics.serve(self.settings.metrics_port)
        log.info(
            "kvcache: %s side, role %s, namespace %s, chunk %d tokens",
            role.name,
            tc.kv_role,
            namespace.prefix(),
            namespace.chunk_tokens,
        )

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches, self._num_blocks, self.block_size)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVCacheStepMetadata) and self.worker is not None
        if meta.handoffs and self.worker.engine.tp_rank == 0:
            metrics.record_handoffs(meta.handoffs)
        self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVCacheStepMetadata) and self.worker is not None
        self.worker.save_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        assert self.worker is not None
        meta = self._connector_metadata
        self.worker.wait_for_save(meta if isinstance(meta, KVCacheStepMetadata) else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVCacheWorkerReport | None:
        return self.worker.take_report() if self.worker is not None else None

    def get_kv_connector_stats(self) -> metrics.KVCacheStats | None:
        return self.worker.take_stats() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> metrics.KVCacheStats:
        return metrics.KVCacheStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        if not self._cacheable(request):
            return 0, False
        adapter = None
        if request.lora_request is not None:
            # The adapter's name and content fingerprint root the chain, so no other adapter
            # (nor the base) shares its keys; None: it cannot be fingerprinted, not cached.
            adapter = _adapter_identity(request.lora_request)
            if adapter is None:
                return 0, False
        prompt = list(request.prompt_token_ids or [])
        salt = getattr(request, "cache_salt", None)
        # A decode call after a prefill carries what the prefill stored (kvcache.handoff);
        # None from the scheduler = pending until L2 holds it: vLLM asks again next step.
        handoff = Handoff.from_params(request.kv_transfer_params)
        matched = self.scheduler.num_matched_tokens(
            request.request_id, prompt, num_computed_tokens, salt, handoff, adapter
        )
        return matched, False

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        if not self.scheduler.line.depth or not self._cacheable(request):
            return
        adapter = None
        if request.lora_request is not None:
            adapter = _adapter_identity(request.lora_request)
            if adapter is None:
                return
        self.scheduler.on_new_request(
            request.request_id, list(request.prompt_token_ids or []), getattr(request, "cache_salt", None),
            adapter,
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        prompt = list(request.prompt_token_ids or [])
        self.scheduler.after_alloc(request.request_id, prompt, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_meta(scheduler_output, {})

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, KVCacheWorkerReport):
            self.scheduler.on_worker_report(report)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        params = None
        if _wants_remote_decode(request):
            # A prefill for a decode instance: name what this request stored, so the decode
            # call waits until L2 holds it (the writes run behind the request).
            handoff = self.scheduler.handoff(request.request_id)
            params = handoff.to_params() if handoff is not None else None
        self.scheduler.finished(request.request_id)
        # Saves are copied out of the paged cache within the step (L2 writes work from that
        # copy), so blocks can be freed now; the decode side waits for L2, not for us.
        return False, params

    @staticmethod
    def _cacheable(request: Request) -> bool:
        return not (request.mm_features or getattr(request, "prompt_embeds", None) is not None)


def _adapter_identity(lora_request: Any) -> str | None:
    """The adapter's identity, or None (counted, logged once per adapter): not cached."""
    try:
        return adapter_identity(lora_request)
    except AdapterUnavailable as exc:
        metrics.LORA_UNCACHED.labels(exc.reason).inc()
        if first_warning(lora_request.lora_name):
            log.warning(
                "kvcache: requests for LoRA adapter %s bypass the cache: %s", lora_request.lora_name, exc
            )
        return None


def _wants_remote_decode(request: Request) -> bool:
    """A prefill call (vLLM's P/D convention: ``do_remote_decode``) that ran to its end;
    an aborted one stored an unknown part of its prompt, so it names nothing."""
    from vllm.v1.request import RequestStatus

    params = request.kv_transfer_params
    return bool(
        isinstance(params, dict)
        and params.get("do_remote_decode")
        and request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
    )
