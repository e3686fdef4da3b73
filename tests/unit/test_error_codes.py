"""The batch's error codes have one home (batch/error_codes.py), one table in the docs, and no copies."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from aibrix_operators.batch.error_codes import ALL_CODES, RequestError, ValidationCode

REPO = Path(__file__).resolve().parents[2]
HOME = REPO / "plugins" / "aibrix_operators" / "batch" / "error_codes.py"
TABLE = REPO / "docs" / "failure-semantics.md"
CODES = {str(m): type(m).__name__ for enum in ALL_CODES for m in enum}
# The same word in another vocabulary, where it stays a literal: (file under plugins/aibrix_operators/,
# value). Anything not listed here fails the scan.
ELSEWHERE = {
    # The Batch API's HTTP request errors (an upload or create request, before any batch exists).
    ("batch_api/upload.py", ValidationCode.FILE_TOO_LARGE),
    ("batch_api/upload.py", ValidationCode.MISSING_REQUIRED_PARAMETER),
    ("batch_api/upload.py", ValidationCode.EMPTY_FILE),
    ("batch_api/app.py", ValidationCode.FILE_TOO_LARGE),
    ("batch_api/app.py", ValidationCode.MISSING_REQUIRED_PARAMETER),
    ("batch_api/batches.py", ValidationCode.INVALID_COMPLETION_WINDOW),
    ("batch_api/batches.py", ValidationCode.INVALID_ENDPOINT),
    # "timeout" is also a trigger event's status and a router metrics label.
    ("operators/driver_pod.py", RequestError.TIMEOUT),
    ("triggers/dropzone.py", RequestError.TIMEOUT),
    ("router/proxy.py", RequestError.TIMEOUT),
    ("triggers/batch_api.py", RequestError.TIMEOUT),
    ("operators/batch_api.py", RequestError.TIMEOUT),
}


@pytest.mark.service
def test_codes_are_spelled_only_in_error_codes() -> None:
    package = REPO / "plugins" / "aibrix_operators"
    found = []
    for path in [*(REPO / "plugins").rglob("*.py"), *(REPO / "dags").rglob("*.py")]:
        if path == HOME:
            continue
        where = path.relative_to(package).as_posix() if path.is_relative_to(package) else None
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in CODES:
                if (where, node.value) not in ELSEWHERE:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert found == []


def test_each_code_is_one_word_in_one_enum_with_its_comment() -> None:
    members = [m for enum in ALL_CODES for m in enum]
    assert len(CODES) == len(members)  # no value in two enums
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", m) for m in members)
    lines = HOME.read_text().splitlines()
    for node in ast.walk(ast.parse(HOME.read_text())):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.Assign):
                    comment = lines[item.lineno - 2].strip()
                    assert comment.startswith("#") and "retry" in comment, (node.name, item.lineno)


def test_the_docs_table_lists_every_code_and_only_real_ones() -> None:
    text = TABLE.read_text()
    section = text.split("\n## Error codes\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| `(\w+)` \|", section, flags=re.M)
    documented = dict(rows)
    assert len(rows) == len(documented)  # each code once
    assert documented == CODES


# The failure types a step can raise, by where they live: each says its code and whether a retry
# helps (CodedFailure), read by step_errors and dispatch. A new one joins this list.
CODED = {
    "aibrix_operators.driver.preflight": {"EndpointUnavailable": ("endpoint_unavailable", True),
                                          "ModelNotServed": ("model_not_served", False),
                                          "SharedModeRefused": ("capacity_mode_refused", False)},
    "aibrix_operators.capacity.mode": {"CapacityRefused": ("capacity_mode_refused", False)},
    "aibrix_operators.driver.health": {"EndpointOutage": ("endpoint_unavailable", True)},
    "aibrix_operators.driver.checkpoint": {"CheckpointWriteFailed": ("storage_error", True)},
    "aibrix_operators.storage": {"StorageError": ("storage_error", True)},
    "aibrix_operators.batch.shard_answers": {"ExactlyOnceViolation": ("exactly_once_violation", False)},
    "aibrix_operators.driver.shard_outcome": {"ShardChanged": ("input_changed", False)},
    "aibrix_operators.trust.policy": {"TrustViolation": ("refused_by_policy", False)},
    "aibrix_operators.lora.serving": {"AdapterLoadFailed": ("adapter_load_failed", False),
                                      "AdapterServerUnreachable": ("endpoint_unavailable", True),
                                      "AdapterStoreUnavailable": ("storage_error", True)},
    "aibrix_operators.lora.registry": {"AdapterRegistryError": ("invalid_adapter_registry", False)},
}


def test_each_failure_type_carries_its_code_and_whether_a_retry_helps() -> None:
    import importlib

    from aibrix_operators.batch.error_codes import BatchFailure, CodedFailure
    from aibrix_operators.operators.step_errors import step_error_code

    for module, classes in CODED.items():
        mod = importlib.import_module(module)
        for name, (code, retryable) in classes.items():
            cls = getattr(mod, name)
            assert issubclass(cls, CodedFailure), name
            assert (cls.error_code, cls.retryable) == (BatchFailure(code), retryable), name
            exc = cls.__new__(cls)  # the code is the class's, whatever its constructor takes
            try:
                raise RuntimeError("a step's wrapper") from exc
            except RuntimeError as outer:
                assert step_error_code(outer, "dispatch") == code, name  # found along the cause chain
    # No table of class names is left: step_errors reads the classes themselves.
    source = (REPO / "plugins/aibrix_operators/operators/step_errors.py").read_text()
    assert not any(name in source for classes in CODED.values() for name in classes)
