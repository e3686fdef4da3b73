"""SlotKeepingLocalExecutor: Airflow's LocalExecutor queues and slot accounting, with the test
playing the worker process (it takes workloads off the activity queue and reports their ends in
whatever order a loaded machine produces). The end-to-end effects, deadline order with one
slot and no try lost to a reschedule, are in tests/integration (test_deadline_order_vllm.py,
batch_client_cases.py)."""

from __future__ import annotations

import ctypes
import multiprocessing
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from airflow.executors.local_executor import LocalExecutor
from airflow.models.taskinstancekey import TaskInstanceKey
from airflow.utils.state import TaskInstanceState

from aibrix_operators.scheduling.slot_keeping_executor import SlotKeepingLocalExecutor


@dataclass(frozen=True)
class Workload:
    """What the executor's queues read of a task workload."""

    key: TaskInstanceKey
    running_state: None = None

    @property
    def ti(self) -> SimpleNamespace:
        return SimpleNamespace(priority_weight=1)


class WorkerlessExecutor(SlotKeepingLocalExecutor):
    """No worker processes: the test takes the workloads and reports their ends."""

    def _check_workers(self) -> None:
        pass


class PlainWorkerless(LocalExecutor):
    def _check_workers(self) -> None:
        pass


def started(executor_class: type[LocalExecutor], parallelism: int) -> LocalExecutor:
    executor = executor_class(parallelism=parallelism)
    executor.activity_queue = multiprocessing.SimpleQueue()
    executor.result_queue = multiprocessing.SimpleQueue()
    executor.workers = {}
    executor._unread_messages = multiprocessing.Value(ctypes.c_uint)
    return executor


def key(task: str, try_number: int = 1) -> TaskInstanceKey:
    return TaskInstanceKey("batch_inference", task, "run-1", try_number, -1)


def queue(executor: LocalExecutor, *keys: TaskInstanceKey) -> None:
    for k in keys:
        executor.queued_tasks[k] = Workload(k)


def taken(executor: LocalExecutor) -> list[TaskInstanceKey]:
    out = []
    while not executor.activity_queue.empty():
        out.append(executor.activity_queue.get().key)
    return out


def ti(k: TaskInstanceKey) -> SimpleNamespace:
    return SimpleNamespace(id=f"ti-{k.task_id}", key=k)


def test_a_dispatched_task_holds_its_slot_until_its_end_is_read() -> None:
    executor = started(WorkerlessExecutor, parallelism=1)
    queue(executor, key("validate"))
    executor.heartbeat()
    assert taken(executor) == [key("validate")]
    # The scheduler asks slots_available before queueing more: none while it runs.
    assert executor.slots_available == 0 and executor.has_task(ti(key("validate")))
    queue(executor, key("split"))
    executor.heartbeat()
    assert taken(executor) == []  # waits in the executor, not in the worker's queue
    executor.result_queue.put((key("validate"), TaskInstanceState.SUCCESS, None))
    executor.heartbeat()  # reads the end (sync), then the next heartbeat dispatches
    assert executor.get_event_buffer() == {key("validate"): (TaskInstanceState.SUCCESS, None)}
    executor.heartbeat()
    assert taken(executor) == [key("split")]


def test_airflows_own_local_executor_frees_the_slot_at_dispatch() -> None:
    """What the subclass is for (apache/airflow#71914): without it, a dispatched task leaves
    the slot free and the scheduler queues the next at once."""
    executor = started(PlainWorkerless, parallelism=1)
    queue(executor, key("validate"))
    executor.heartbeat()
    assert taken(executor) == [key("validate")]
    assert executor.slots_available == 1 and not executor.has_task(ti(key("validate")))


def test_the_end_of_a_run_before_a_reschedule_leaves_the_next_run_known() -> None:
    """A task rescheduled and queued again (same try number) before the end of its previous
    run was read: that end must not make the new run look unknown, or the scheduler fails the
    task as killed externally (apache/airflow#71172)."""
    executor = started(WorkerlessExecutor, parallelism=2)
    shard = key("dispatch")
    queue(executor, shard)
    executor.heartbeat()
    queue(executor, shard)  # the reschedule's next check, same key
    executor.heartbeat()
    assert taken(executor) == [shard, shard]
    executor.result_queue.put((shard, TaskInstanceState.SUCCESS, None))  # the first check's end
    executor.sync()
    assert executor.has_task(ti(shard)) and executor.slots_available == 1
    assert executor.get_event_buffer() == {shard: (TaskInstanceState.SUCCESS, None)}
    executor.result_queue.put((shard, TaskInstanceState.SUCCESS, None))  # the second's
    executor.sync()
    assert not executor.has_task(ti(shard)) and executor.slots_available == 2


def test_a_started_report_keeps_the_slot() -> None:
    """Callbacks report a start before their end: the start frees nothing."""
    executor = started(WorkerlessExecutor, parallelism=1)
    callback = key("on_failure_callback")
    queue(executor, callback)
    executor.heartbeat()
    taken(executor)
    executor.result_queue.put((callback, TaskInstanceState.RUNNING, None))
    executor.sync()
    assert executor.slots_available == 0
    executor.result_queue.put((callback, TaskInstanceState.FAILED, None))
    executor.sync()
    assert executor.slots_available == 1
    assert executor.get_event_buffer() == {callback: (TaskInstanceState.FAILED, None)}


def test_the_deployments_executor_name_is_this_class() -> None:
    import importlib

    from aibrix_operators.localenv import EXECUTOR, airflow_env

    module, name = EXECUTOR.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is SlotKeepingLocalExecutor
    assert airflow_env()["AIRFLOW__CORE__EXECUTOR"] == EXECUTOR


@pytest.mark.service
def test_an_airflow_it_was_not_verified_on_stops_the_scheduler_with_what_to_do(tmp_path) -> None:
    """The class leans on how LocalExecutor behaves: on an Airflow it was not verified on, loading
    the executor (the scheduler's first step) fails with the way forward, not at a result read."""
    import os
    import subprocess
    import sys

    from aibrix_operators.localenv import airflow_env

    # The deployment's configuration names the executor; the scheduler loads it by that name.
    env = {**airflow_env(tmp_path / "home"), "PATH": os.environ["PATH"]}

    probe = (
        "import airflow; airflow.__version__ = '{}'\n"
        "from airflow.executors.executor_loader import ExecutorLoader\n"
        "ExecutorLoader.get_default_executor()\n"
        "print('loaded')\n"
    )
    newer = subprocess.run([sys.executable, "-c", probe.format("3.4.0")], capture_output=True, text=True,
                           timeout=120, env=env)  # fmt: skip
    assert newer.returncode != 0 and "loaded" not in newer.stdout
    assert "verified on Airflow 3.3, and Airflow 3.4.0 is installed" in newer.stderr, newer.stderr[-2000:]
    assert "test_airflows_own_local_executor_frees_the_slot_at_dispatch" in newer.stderr
    verified = subprocess.run([sys.executable, "-c", probe.format("3.3.9")], capture_output=True,
                              text=True, timeout=120, env=env)  # fmt: skip
    assert verified.stdout.strip().splitlines()[-1] == "loaded", verified.stderr[-2000:]
