"""What a failed step tells ``record_failure``: a specific code and a one-line message, by XCom.

Airflow keeps a task's exception in its log only; the batch record needs it in
words a user can act on. A step's ``execute`` wrapped by ``records_step_error``
pushes ``{"code", "message", "task"}`` under ``STEP_ERROR_KEY`` before the
exception propagates (Airflow clears a task's XComs when it is retried, so only
the last attempt's error remains).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from aibrix_operators.batch.error_codes import BatchFailure, CodedFailure
from aibrix_operators.batch.failures import one_line

STEP_ERROR_KEY = "step_error"

F = TypeVar("F", bound=Callable[..., Any])


def step_error_code(exc: BaseException, step: str) -> str:
    """The code of the first failure along the cause chain that says its own (``CodedFailure``:
    the failure table is its subclasses), else ``<step>_failed``."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, CodedFailure):
            return cur.error_code
        cur = cur.__cause__ or cur.__context__
    return step_failed_code(step)


def step_failed_code(step: str) -> BatchFailure:
    """``<step>_failed``: what a step's failure without a code of its own is recorded as."""
    return BatchFailure(f"{step}_failed")


def records_step_error(step: str) -> Callable[[F], F]:
    """Decorate an operator's ``execute(self, context)`` (or a resume method after a deferral) to
    publish its failure for ``record_failure``."""
    step_failed_code(step)  # a ValueError at import for a step whose code is not in BatchFailure

    def wrap(execute: F) -> F:
        @functools.wraps(execute)
        def run(self: Any, context: Any, *args: Any, **kwargs: Any) -> Any:  # also resume methods (event=...)
            try:
                return execute(self, context, *args, **kwargs)
            except Exception as exc:
                ti = context["ti"]
                index = getattr(ti, "map_index", -1)
                task = ti.task_id if index is None or index < 0 else f"{ti.task_id}[{index}]"
                try:
                    ti.xcom_push(key=STEP_ERROR_KEY, value={
                        "code": step_error_code(exc, step), "task": task,
                        "message": one_line(str(exc) or type(exc).__name__),
                    })
                except Exception:  # noqa: BLE001 - never hide the real failure behind this one
                    pass
                raise

        return run  # type: ignore[return-value]

    return wrap


def collect_step_errors(ti: Any, task_ids: Iterable[str], limit: int = 100) -> list[dict[str, Any]]:
    """The errors the failed steps published, as OpenAI error entries (at most ``limit``)."""
    found = ti.xcom_pull(task_ids=list(task_ids), key=STEP_ERROR_KEY) or []
    if isinstance(found, dict):
        found = [found]
    errors = []
    for item in found:
        if isinstance(item, dict) and item.get("code"):
            message = one_line(f"{item.get('task')}: {item.get('message')}")
            errors.append({"code": item["code"], "message": message, "param": None, "line": None})
    return errors[:limit]
