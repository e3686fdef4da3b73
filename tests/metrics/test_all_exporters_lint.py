"""`promtool check metrics` on every exporter in the repo: driver, eval, batch, router, scaling, kvcache."""

from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client import generate_latest

from tests.metrics.conftest import check_metrics

pytestmark = pytest.mark.service


def _lint(promtool, text: str) -> None:
    result = check_metrics(promtool, text)
    assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr


def test_batch_exposition(promtool):
    from aibrix_operators.batch.metrics import BatchSnapshot, registry_for

    snap = BatchSnapshot("batch_x", "in_progress", requests=10, completed=7, failed=1, shards=3,
                         shards_done=2, created_at=1.7e9, deadline=1.7e9 + 86400)
    text = generate_latest(registry_for(snap)).decode()
    assert text.count("# TYPE aibrix_batch_") == 9  # every batch gauge is linted
    _lint(promtool, text)


def test_router_exposition(promtool):
    from aibrix_operators.router.metrics import RouterMetrics

    _lint(promtool, generate_latest(RouterMetrics().registry).decode())


def test_scaling_exposition(promtool):
    from aibrix_operators.scaling import metrics as scaling

    _lint(promtool, generate_latest(scaling.REGISTRY).decode())


def test_kvcache_exposition(promtool):
    from kvcache import metrics as kv  # noqa: F401 - registers on the default registry

    text = generate_latest(prometheus_client.REGISTRY).decode()
    assert "kvcache_lookup_hit_tokens_total" in text
    _lint(promtool, text)
