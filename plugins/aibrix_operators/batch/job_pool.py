"""Job-pool settings: AIBrix's ``pool:`` keys plus this pipeline's, from one YAML file.

::

    pool:
      max_workers: 2          # shards of this batch dispatched at once
      memory_per_job: 2Gi     # each driver pod's memory request and limit (execution_mode=kubernetes)
      gpu_policy: spread      # how the serving group is placed: pack | spread (the deployment's)
      requests_per_shard: 500
      concurrency: 32         # requests in flight per shard

The same mapping comes from the CLI's ``--config``, the client's ``pool=``, the Batch API's
``pool`` extension field and the DAG's params of these names. Here: the shape of each value.
The deployment's limits on them (``JobPoolLimits``) are checked where the batch runs, inside
Airflow, because whoever sends a pool file is untrusted (docs/job-pool.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aibrix_operators.trust.policy import TrustViolation

GPU_POLICIES = ("pack", "spread")
KEYS = ("max_workers", "memory_per_job", "gpu_policy", "requests_per_shard", "concurrency")
MIN_MEMORY_BYTES = 64 * 2**20  # the driver's own footprint (~40 MiB RSS) and a little room
MAX_FILE_BYTES = 64 * 1024  # a pool file is a few lines; a bigger one is not a pool file
# A Kubernetes memory quantity: a decimal number and an optional binary or decimal suffix. The
# class [0-9] is ASCII only (``\d`` would take any script's digits, which Kubernetes refuses).
_QUANTITY = re.compile(r"(?P<num>[0-9]+(?:\.[0-9]+)?)(?P<unit>Ki|Mi|Gi|Ti|Pi|k|K|M|G|T|P)?")
# Longer is no memory size: 999Pi is 21 characters. Bounds the work the parser does on what an
# untrusted pool file, DAG param or API request sends (a 400-digit number once overflowed a
# float here and answered 500).
MAX_QUANTITY_CHARS = 24
_UNITS = {None: 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


class JobPoolError(ValueError):
    """A pool setting of the wrong shape; the message names the key and what would be right."""


class PoolLimitExceeded(TrustViolation):
    """A pool setting over the deployment's limit: refused by the limit's name, never clipped."""

    def __init__(self, rule: str, message: str) -> None:
        Exception.__init__(self, f"refused by the deployment's limit {rule}: {message}")
        self.rule = rule


def memory_bytes(quantity: str, key: str = "memory_per_job") -> int:
    """``2Gi`` -> 2147483648. Raises JobPoolError for what Kubernetes would not read as memory.

    Exact integer arithmetic (no float): a fraction of a byte rounds up, as Kubernetes does."""
    if len(quantity) > MAX_QUANTITY_CHARS:
        raise JobPoolError(f"{key} may be at most {MAX_QUANTITY_CHARS} characters (a Kubernetes "
                           f"memory quantity such as 512Mi or 2Gi); this one has {len(quantity)}")
    match = _QUANTITY.fullmatch(quantity)
    if match is None:
        raise JobPoolError(f"{key} {quantity[:40]!r} is not a Kubernetes memory quantity "
                           "(e.g. 512Mi, 2Gi, 1500M)")
    whole, _, fraction = match["num"].partition(".")
    scale = 10 ** len(fraction)
    scaled = (int(whole) * scale + int(fraction or "0")) * _UNITS[match["unit"]]
    return -(-scaled // scale)


@dataclass(frozen=True)
class JobPool:
    """One batch's pool settings; None: the deployment's default for that setting."""

    max_workers: int | None = None
    memory_per_job: str | None = None
    gpu_policy: str | None = None
    requests_per_shard: int | None = None
    concurrency: int | None = None

    def __post_init__(self) -> None:
        for key in ("max_workers", "requests_per_shard", "concurrency"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise JobPoolError(f"{key} must be a whole number of at least 1, not {value!r}")
        memory = self.memory_per_job
        if memory is not None:
            if not isinstance(memory, str):
                raise JobPoolError(f"memory_per_job must be a quantity such as 2Gi, not {memory!r}")
            if memory_bytes(memory) < MIN_MEMORY_BYTES:
                raise JobPoolError(f"memory_per_job {memory} is below 64Mi, less than the driver needs")
        if self.gpu_policy is not None and self.gpu_policy not in GPU_POLICIES:
            raise JobPoolError(f"gpu_policy must be one of {', '.join(GPU_POLICIES)}, "
                               f"not {self.gpu_policy!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None, where: str = "pool") -> JobPool:
        """From ``{"max_workers": 2, ...}``; an unknown key is an error naming the known ones."""
        if values is None:
            return cls()
        if not isinstance(values, Mapping):
            raise JobPoolError(f"{where} must be a mapping of {', '.join(KEYS)}, not {type(values).__name__}")
        unknown = sorted(str(k) for k in values if k not in KEYS)
        if unknown:
            raise JobPoolError(f"{where} has unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
        try:
            return cls(**{k: values[k] for k in KEYS if k in values})
        except JobPoolError as exc:
            raise JobPoolError(f"{where}: {exc}") from None

    def as_params(self) -> dict[str, Any]:
        """The DAG params this pool sets (only those it sets: the rest keep their defaults)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def check(self, limits: JobPoolLimits) -> None:
        """Raise PoolLimitExceeded naming the first limit a value is over."""
        if self.max_workers is not None and self.max_workers > limits.max_workers:
            raise PoolLimitExceeded("pool_max_workers", f"max_workers {self.max_workers} is over "
                                    f"{limits.max_workers}")
        if self.concurrency is not None and self.concurrency > limits.max_concurrency:
            raise PoolLimitExceeded("pool_max_concurrency", f"concurrency {self.concurrency} is over "
                                    f"{limits.max_concurrency}")
        if self.requests_per_shard is not None and self.requests_per_shard < limits.min_requests_per_shard:
            raise PoolLimitExceeded("pool_min_requests_per_shard", f"requests_per_shard "
                                    f"{self.requests_per_shard} is under {limits.min_requests_per_shard}")
        if self.memory_per_job is not None and (
            memory_bytes(self.memory_per_job) > memory_bytes(limits.max_memory_per_job)
        ):
            raise PoolLimitExceeded("pool_max_memory_per_job", f"memory_per_job {self.memory_per_job} is "
                                    f"over {limits.max_memory_per_job}")
        if self.gpu_policy is not None and self.gpu_policy != limits.gpu_policy:
            raise PoolLimitExceeded("gpu_policy", f"gpu_policy {self.gpu_policy!r}: the serving group is "
                                    f"placed {limits.gpu_policy!r} by the deployment (k8s/components/"
                                    f"gpu-policy-{limits.gpu_policy}); a batch cannot move its pods")


@dataclass(frozen=True)
class JobPoolLimits:
    """The deployment's bounds (``[aibrix_batch] pool_*`` and ``gpu_policy``; settings/job_pool.py)."""

    max_workers: int = 16
    max_concurrency: int = 4096
    min_requests_per_shard: int = 1
    max_memory_per_job: str = "8Gi"
    gpu_policy: str = "spread"

    def __post_init__(self) -> None:
        # A bad setting fails where it is read, by name.
        memory_bytes(self.max_memory_per_job, "[aibrix_batch] pool_max_memory_per_job")
        if self.gpu_policy not in GPU_POLICIES:
            raise JobPoolError(f"[aibrix_batch] gpu_policy must be one of {', '.join(GPU_POLICIES)}, "
                               f"not {self.gpu_policy!r}")


# What a pool file may hold: the job pool and the batch's stop rules (docs/stop-rules.md).
POOL_FILE_KEYS = ("pool", "stop_rules")


def read_pool_file(path: str | Path) -> dict[str, Any]:
    """A pool file's document (YAML: ``pool:`` and/or ``stop_rules:``); JobPoolError says what is
    wrong and where. Each part is checked by its reader (``load_pool_file``, the client's stop rules)."""
    import yaml

    path = Path(path)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise JobPoolError(f"{path} is over {MAX_FILE_BYTES // 1024} KiB; a pool file is a few lines")
        text = path.read_text()
    except FileNotFoundError:
        raise JobPoolError(f"pool file {path} does not exist") from None
    except IsADirectoryError:
        raise JobPoolError(f"pool file {path} is a directory") from None
    except (PermissionError, UnicodeDecodeError) as exc:
        raise JobPoolError(f"cannot read pool file {path}: {exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise JobPoolError(f"pool file {path} is not YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(doc, dict) or not doc or not set(doc) <= set(POOL_FILE_KEYS):
        found = sorted(map(str, doc)) if isinstance(doc, dict) else type(doc).__name__
        raise JobPoolError(f"pool file {path} must hold one mapping, pool: and/or stop_rules: (found "
                           f"{found}); e.g.\npool:\n  max_workers: 2\n  memory_per_job: 2Gi\n"
                           "stop_rules:\n  max_error_rate: 0.2")
    return doc


def load_pool_file(path: str | Path) -> JobPool:
    """The job pool of a pool file (its ``pool:``; none: the defaults)."""
    return JobPool.from_mapping(read_pool_file(path).get("pool") or {}, f"{path}: pool")
