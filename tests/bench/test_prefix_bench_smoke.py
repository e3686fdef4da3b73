"""Smoke test of bench/prefix_batching.py's generator: the file is valid and groups as planned.

The bench's timed runs start vLLM and take minutes (bench/RESULTS.md, `bench/prefix_batching.py`); this
checks only what would silently make them meaningless: a shared-prefix workload that
validation does not see as shared, or a KV-per-token figure that does not match the model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from aibrix_operators.batch.job import prefix_order_uri, validate_batch
from aibrix_operators.storage import LocalStorage

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_shared_workload_is_valid_and_grouped(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import prefix_batching as pb
    finally:
        sys.path.remove(str(BENCH))
    path = tmp_path / "shared.jsonl"
    pb.write_shared(path, 200, prefixes=8, prefix_words=240, model="m", max_tokens=4)
    out = tmp_path / "out"
    report, batch = validate_batch(LocalStorage(), str(path), str(out), prefix_grouping="auto",
                                   prefix_order_uri=prefix_order_uri(str(out / "_work" / "r")))
    assert batch is not None, report.summary()
    assert batch.prefix_order_uri and batch.prefix_groups == 8 and batch.prefix_shared_requests == 200
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 256, "head_dim": 64}))
    assert pb.kv_bytes_per_token(str(model)) == 4096
