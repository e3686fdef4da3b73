"""What a finished (or failed) driver pod means for the task: pure functions over plain data.

The driver CLI says what happened in its exit code and prints its ``ShardOutcome`` as the
last JSON line of stdout; Kubernetes says what happened to the pod in its status (image
pulls, scheduling, evictions, deadlines, OOM kills). ``judge_pod`` combines both into a
``PodVerdict``: the outcome for XCom, or a ``DriverPodFailure`` with a specific error code,
a one-line message a user can act on, and whether an Airflow retry can help.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from aibrix_operators.batch.error_codes import BatchFailure, CodedFailure
from aibrix_operators.driver_pods.spec import CONTAINER_NAME

# Exit codes of ``python -m aibrix_operators.driver.cli`` (see its --help):
# code -> (error code, retryable, what it means). 0 and 1 mean the shard finished.
DRIVER_EXITS: dict[int, tuple[BatchFailure, bool, str]] = {
    2: (
        BatchFailure.DRIVER_BAD_ARGUMENTS,
        False,
        "the driver rejected its arguments (a bug in the pod spec)",
    ),
    3: (
        BatchFailure.ENDPOINT_UNAVAILABLE,
        True,
        "the inference endpoint was unavailable; unanswered requests were "
        "not recorded and the retry sends them",
    ),
    4: (BatchFailure.MODEL_NOT_SERVED, False, "the endpoint does not serve the batch's model"),
    5: (
        BatchFailure.STORAGE_ERROR,
        True,
        "reading the shard or writing checkpoints failed; the retry resumes",
    ),
    6: (BatchFailure.INPUT_CHANGED, False, "the shard changed after it was planned; re-split the batch"),
    70: (
        BatchFailure.DRIVER_INTERNAL_ERROR,
        True,
        "the driver hit an internal error (see the pod log above)",
    ),
}
_IMAGE_PULL = (
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "RegistryUnavailable",
)
_CONFIG = ("CreateContainerConfigError", "CreateContainerError")
OUTCOME_KEYS = frozenset({"total", "completed", "failed"})


class DriverPodFailure(CodedFailure):
    """A driver pod that did not finish its shard; ``error_code`` goes into batch.json. Its code
    and retryability depend on how the pod ended, so they are set per instance."""

    def __init__(self, error_code: str, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.error_code = error_code
        self.retryable = retryable


@dataclass(frozen=True)
class PodVerdict:
    outcome: dict[str, Any] | None  # with "started_at" when the pod said when it started
    failure: DriverPodFailure | None
    exit_code: int | None


def parse_outcome(lines: Iterable[str]) -> dict[str, Any] | None:
    """The last line that is the driver's outcome JSON (stderr log lines interleave with stdout)."""
    found = None
    for line in lines:
        text = line.strip()
        if not (text.startswith("{") and text.endswith("}")):
            continue
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, dict) and OUTCOME_KEYS <= value.keys():
            found = value
    return found


def container_status(pod: dict[str, Any]) -> dict[str, Any]:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == CONTAINER_NAME:
            return status
    return {}


def judge_pod(pod: dict[str, Any] | None, log_lines: list[str], pod_name: str) -> PodVerdict:
    """``pod``: the last Pod object seen (camelCase dict; None if it vanished before it finished)."""
    if pod is None:
        return PodVerdict(
            None,
            DriverPodFailure(
                BatchFailure.DRIVER_POD_LOST,
                f"driver pod {pod_name} disappeared before it finished (deleted, or its node "
                "was lost); the retry resumes from the checkpoints",
                True,
            ),
            None,
        )
    status = pod.get("status") or {}
    state = container_status(pod).get("state") or {}
    terminated = state.get("terminated") or {}
    waiting = state.get("waiting") or {}
    exit_code = terminated.get("exitCode")
    reason, message = status.get("reason"), (status.get("message") or "").strip()

    if reason == "Evicted":
        return _fail(
            BatchFailure.DRIVER_POD_EVICTED,
            f"driver pod {pod_name} was evicted: {message or 'node pressure'}; "
            "the retry resumes from the checkpoints",
            True,
            exit_code,
        )
    if reason == "DeadlineExceeded":
        return _fail(
            BatchFailure.DRIVER_POD_DEADLINE_EXCEEDED,
            f"driver pod {pod_name} ran past its activeDeadlineSeconds (the completion window plus "
            "grace); the retry records the requests still unanswered as batch_expired",
            True,
            exit_code,
        )
    if waiting.get("reason") in _IMAGE_PULL:
        return _fail(
            BatchFailure.DRIVER_IMAGE_PULL_FAILED,
            f"driver pod {pod_name} cannot pull its image {container_status(pod).get('image')!r} "
            f"({waiting['reason']}: {_short(waiting.get('message'))}); fix [aibrix_batch] driver_image "
            "or the registry credentials",
            False,
            exit_code,
        )
    if waiting.get("reason") in _CONFIG:
        return _fail(
            BatchFailure.DRIVER_POD_CONFIG_ERROR,
            f"driver pod {pod_name} cannot start its container ({waiting['reason']}: "
            f"{_short(waiting.get('message'))}); check the Secrets named in [aibrix_batch]",
            False,
            exit_code,
        )
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return _fail(
                BatchFailure.DRIVER_POD_UNSCHEDULABLE,
                f"driver pod {pod_name} could not be scheduled ({cond.get('reason')}: "
                f"{_short(cond.get('message'))}); the retry tries again",
                True,
                exit_code,
            )
    if terminated.get("reason") == "OOMKilled":
        return _fail(
            BatchFailure.DRIVER_POD_OOM_KILLED,
            f"driver pod {pod_name} was OOM-killed; raise [aibrix_batch] "
            "driver_memory_limit; the retry resumes from the checkpoints",
            True,
            exit_code,
        )
    if exit_code in (0, 1):
        outcome = parse_outcome(log_lines)
        if outcome is None:
            return _fail(
                BatchFailure.DRIVER_OUTCOME_MISSING,
                f"driver pod {pod_name} finished (exit {exit_code}) but its outcome line could not be "
                "read from its log; the retry re-reads the finished shard",
                True,
                exit_code,
            )
        started = container_started_at(pod)
        return PodVerdict({**outcome, "started_at": started} if started else outcome, None, exit_code)
    if exit_code in DRIVER_EXITS:
        code, retryable, meaning = DRIVER_EXITS[exit_code]
        last = _last_error_line(log_lines)
        return _fail(
            code,
            f"driver pod {pod_name} exited {exit_code}: {meaning}" + (f" ({last})" if last else ""),
            retryable,
            exit_code,
        )
    if exit_code is not None:
        signal_note = f" (signal {exit_code - 128})" if exit_code > 128 else ""
        return _fail(
            BatchFailure.DRIVER_POD_FAILED,
            f"driver pod {pod_name} exited {exit_code}{signal_note}; the retry resumes from the checkpoints",
            True,
            exit_code,
        )
    phase = status.get("phase") or "Unknown"
    return _fail(
        BatchFailure.DRIVER_POD_FAILED,
        f"driver pod {pod_name} did not finish (phase {phase}"
        + (f": {_short(message)}" if message else "")
        + ")",
        True,
        None,
    )


def container_started_at(pod: dict[str, Any] | None) -> int | None:
    """When the driver container started (seconds since the epoch), from its terminated state."""
    state = container_status(pod or {}).get("state") or {}
    stamp = (state.get("terminated") or state.get("running") or {}).get("startedAt")
    if not stamp:
        return None
    try:
        return int(datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp())
    except ValueError:
        return None


def _fail(code: str, message: str, retryable: bool, exit_code: int | None) -> PodVerdict:
    return PodVerdict(None, DriverPodFailure(code, message, retryable), exit_code)


def _short(text: str | None, limit: int = 300) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _last_error_line(lines: list[str]) -> str:
    for line in reversed(lines):
        if " ERROR " in line or " CRITICAL " in line:
            return _short(line.split(": ", 1)[-1], 200)
    return ""
