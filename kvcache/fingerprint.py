"""A fingerprint of a model's weights, for the key namespace.

Weights replaced under the same path (no revision) must not share keys with the old ones.
The fingerprint samples each weight file's *content* (size plus the first, middle and last
MiB) and hashes the config files whole. It does not use modification times: copies of the
same weights on different nodes must agree, so that instances can share an L2.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WHOLE_FILES = ("config.json", "generation_config.json", "quant_config.json", "hf_quant_config.json")
_SAMPLE = 1 << 20


@functools.lru_cache(maxsize=8)
def weights_fingerprint(model: str) -> str:
    """Hex fingerprint of the weights under a local model directory; "" when ``model`` is not
    a local directory (a hub id: pin ``revision``, or set ``model_fingerprint``)."""
    root = Path(model)
    if not root.is_dir():
        return ""
    h = hashlib.blake2b(digest_size=16)
    found = False
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if path.name in _WHOLE_FILES:
            h.update(f"{rel}\0".encode())
            h.update(path.read_bytes())
            found = True
        elif path.suffix in _WEIGHT_SUFFIXES:
            size = path.stat().st_size
            h.update(f"{rel}\0{size}\0".encode())
            with open(path, "rb") as f:
                for offset in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                    f.seek(offset)
                    h.update(f.read(_SAMPLE))
            found = True
    return h.hexdigest() if found else ""
