"""Fixtures that start real services: vLLM CPU servers, SeaweedFS, Airflow."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver

from aibrix_operators.local_airflow import airflow_cli
from aibrix_operators.localenv import REPO_ROOT, WORK_DIR, airflow_env
from aibrix_operators.serving.local_vllm import COMPACT_ENGINE_ENV, VLLMServer, VLLMServerSpec
from tests.fake_openai import FakeOpenAI
from tests.integration.dags_test_server import base_key
from tests.integration.services import S3Server, start_seaweedfs, stop_group
from tests.starts import COUNTER as STARTS

INFERENCE_PYTHON = REPO_ROOT / ".venv-inference" / "bin" / "python"
TINY_MODEL = WORK_DIR / "models" / "tiny-llama"
SERVED_NAME = "tiny-llama"
# The fake OpenAI server (tests/fake_openai.py) as a model a deployment serves, for tests whose
# requests must take long but need no tokens: a request whose body has ``fault: ["ok@S"]`` is
# answered after S seconds, at no CPU (two Batch API tests that used vLLM's long generations for
# time: 308 CPU-s with their stack, 147 on this; batch_client_cases.py).
PACED_MODEL = "paced-stub"


def run_batch_env() -> dict[str, str]:
    """The environment of a ``vllm run_batch`` the tests compare with: offline, the compact engine
    of the servers it is compared with, and the temporary folder the servers use (``.work/tmp``).

    Not the test's ``tmp_path``: vLLM puts its engine's IPC socket there, and a socket path has a
    107-byte limit that ``/tmp/pytest-of-root/pytest-12/popen-gw1/test_output_lines_match_vllm_r0/
    <uuid>`` overflowed once pytest's session count reached two digits (a clean clone, 2026-12-07).
    """
    tmp = WORK_DIR / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "VLLM_CACHE_ROOT": str(WORK_DIR / "cache"), "HF_HUB_OFFLINE": "1",
            "TMPDIR": str(tmp), **COMPACT_ENGINE_ENV}

@pytest.fixture(scope="session")
def tiny_model() -> Path:
    if not (TINY_MODEL / "config.json").exists():
        subprocess.run(
            [str(INFERENCE_PYTHON), str(REPO_ROOT / "inference_images/vllm/make_model.py"),
             str(TINY_MODEL), "--preset", "tiny"], check=True,
        )
    return TINY_MODEL


@pytest.fixture(scope="session")
def vllm_chat(tiny_model: Path) -> Iterator[VLLMServer]:
    spec = VLLMServerSpec(model=str(tiny_model), served_model_name=SERVED_NAME, compact_engine=True,
                          extra_args=["--enable-prompt-tokens-details"])
    with VLLMServer(spec) as server:
        yield server


@pytest.fixture(scope="session")
def airflow_session_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("airflow-home")
    env = {**os.environ, **airflow_env(home)}
    # A stray AWS endpoint in the caller's environment must not leak into local runs.
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(key, None)
    env.update(allow_list_env(tmp_path_factory.getbasetemp()))
    # The tests use windows of seconds and minutes (expiry in 12 s, deadline order with 20 m):
    # this deployment's floor is lowered to 1 s; the default (1h) is tested in tests/unit.
    env["AIRFLOW__AIBRIX_BATCH__MIN_COMPLETION_WINDOW"] = "1s"
    # DAG files re-parsed every 2 minutes: no test edits one under a running stack, and re-parsing
    # every 30 s (Airflow's default) cost every idle stack's dag-processor 2.3 CPU-s a minute,
    # 0.3 without re-parses (2026-12-06, one idle stack, 60 s), on a suite that is CPU-bound. A new file is
    # still found at the next bundle refresh (localenv: 5 s); a parse that failed is retried.
    env["AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL"] = "120"
    migrated = airflow_cli(env, "db", "migrate")
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    return env


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    """The fake OpenAI server (tests/fake_openai.py) serving SERVED_NAME, on 127.0.0.1, per test."""
    with FakeOpenAI(model=SERVED_NAME).start() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"), "aibrix-test-key", "aibrix-test-secret")
    try:
        yield server
    finally:
        stop_group(server.proc)


# The S3 bucket the integration tests read and write.
TEST_BUCKET = "batch-test"
TEST_INFERENCE_CONN = "inference_test"


def allow_list_env(tmp_root: Path) -> dict[str, str]:
    """The deployment allow-list the tests run under, set the way a deployment sets it
    (Airflow config by environment): the local-development entries, plus the tests'
    temporary directories, their S3 bucket and connections."""
    return {
        "AIRFLOW__AIBRIX_BATCH__ALLOWED_ENDPOINTS": "http://127.0.0.1:*, http://localhost:*",
        "AIRFLOW__AIBRIX_BATCH__ALLOWED_STORAGE": ",".join([
            str(REPO_ROOT / "examples"), str(WORK_DIR), str(tmp_root), f"s3://{TEST_BUCKET}/",
        ]),
        "AIRFLOW__AIBRIX_BATCH__ALLOWED_AWS_CONN_IDS": "<default>, batch_s3",
        "AIRFLOW__AIBRIX_BATCH__ALLOWED_INFERENCE_CONN_IDS": TEST_INFERENCE_CONN,
    }


class DagsTestServers:
    """One tests/integration/dags_test_server.py per base environment (its ``base_key``), started at
    a worker's first `dags test` run with that base and stopped when the worker exits."""

    def __init__(self) -> None:
        self.servers: dict[tuple, subprocess.Popen] = {}
        atexit.register(self.stop)

    def server(self, env: dict[str, str]) -> subprocess.Popen:
        key = base_key(env)
        proc = self.servers.get(key)
        if proc is not None and proc.poll() is None:
            return proc
        log = WORK_DIR / "logs" / f"dags-test-server-{os.getpid()}-{len(self.servers)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        # Per-run settings stay out of the server's own environment: each child takes its request's.
        own = {k: v for k, v in env.items() if not k.startswith(("AIRFLOW_CONN_", "AIRFLOW_VAR_", "AWS_"))}
        with log.open("ab") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "tests.integration.dags_test_server"], env=own,
                                    cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=stderr, text=True)  # fmt: skip
        ready = proc.stdout.readline()
        assert ready.strip() == '{"ready": true}', f"the dags-test server did not start; its log: {log}"
        self.servers[key] = proc
        return proc

    def run(
        self, argv: list[str], env: dict[str, str], out_dir: Path, timeout_s: float
    ) -> subprocess.CompletedProcess:
        proc = self.server(env)
        out_dir.mkdir(parents=True, exist_ok=True)
        stdout, stderr = out_dir / "dags-test.stdout", out_dir / "dags-test.stderr"
        proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(REPO_ROOT), "stdout": str(stdout),
                                     "stderr": str(stderr), "timeout_s": timeout_s}) + "\n")
        proc.stdin.flush()
        answer = proc.stdout.readline()
        assert answer, f"the dags-test server exited (rc {proc.wait()})"
        result = json.loads(answer)
        STARTS.counts["dags_test_runs"] += 1  # a forked run: no process start for the hook to see
        out = stdout.read_text(errors="replace")
        err = stderr.read_text(errors="replace")
        if result["timed_out"]:
            raise subprocess.TimeoutExpired(["airflow", *argv], timeout_s, output=out, stderr=err)
        return subprocess.CompletedProcess(["airflow", *argv], result["rc"], out, err)

    def stop(self) -> None:
        for proc in self.servers.values():
            if proc.poll() is None:
                proc.stdin.close()  # the server ends at the end of its input
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self.servers.clear()


DAGS_TEST = DagsTestServers()


def dags_test(env: dict[str, str], conf: dict, log_dir: Path) -> subprocess.CompletedProcess:
    """Run batch_inference in-process as `airflow dags test` does, in a process forked for the run
    (dags_test_server.py: Airflow's imports and execution-API routes built once a worker, not once a
    run); keep its log for failures."""
    # -f: parse only the DAG's own file, as a task's process does (the whole folder costs
    # 11.5 s of CPU per run against 5.0 s, 2026-12-05).
    argv = ["dags", "test", "batch_inference", "-f", str(REPO_ROOT / "dags" / "batch_inference.py"),
            "-c", json.dumps(conf)]  # fmt: skip
    proc = DAGS_TEST.run(argv, env, log_dir, timeout_s=900)
    (log_dir / "dags-test.log").write_text(proc.stdout + proc.stderr)
    return proc


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat_requests(n: int, model: str = SERVED_NAME, max_tokens: int = 8) -> list[dict]:
    return [
        {"custom_id": f"req-{i:04d}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                  "messages": [{"role": "user", "content": f"item {i}: summarize the batch pipeline"}]}}
        for i in range(n)
    ]


def most_at_once(intervals: list[tuple[str, str]]) -> int:
    """The most intervals open at one instant (ISO timestamps; an end before a start at a tie)."""
    events = sorted([(datetime.fromisoformat(start), 1) for start, _ in intervals]
                    + [(datetime.fromisoformat(end), -1) for _, end in intervals])
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def read_jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# Headless Chromium for the UI tests (the trigger form, monitor_url): one per test.
def system_binary(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        # A missing browser is a broken setup, not a reason to skip: `make setup` installs it.
        raise FileNotFoundError(f"{name} not on PATH: apt-get install -y {package} (make setup)")
    return path


@pytest.fixture
def browser(tmp_path) -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = system_binary("chromium", "chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1400,1000"):
        options.add_argument(arg)
    # An explicit driver path: Selenium Manager would otherwise try to download one.
    service = Service(system_binary("chromedriver", "chromium-driver"),
                      log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()
