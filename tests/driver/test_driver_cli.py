"""The driver CLI as an operator (and a driver pod) uses it: help, one-line errors, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aibrix_operators.driver import cli
from aibrix_operators.serving.local_vllm import free_port
from tests.driver.test_driver_faults import write_shard


def run_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aibrix_operators.driver.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def base_args(tmp_path, endpoint: str, shard: str) -> list[str]:
    return ["--shard-uri", shard, "--results-prefix", str(tmp_path / "results"), "--endpoint", endpoint,
            "--backoff-base", "0.01", "--backoff-max", "0.1", "--max-attempts", "2",
            "--flush-interval", "0.05", "--progress-interval", "0.5"]


@pytest.mark.service
def test_help_documents_every_flag_env_and_exit_codes(tmp_path):
    proc = run_cli("--help", cwd=tmp_path)
    assert proc.returncode == 0
    parser = cli.build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
        for flag in action.option_strings:
            assert flag in proc.stdout
    for text in ("OPENAI_API_KEY", "OPENAI_API_KEY_ORIGIN", "AWS_ACCESS_KEY_ID", "exit codes",
                 "SECONDS"):
        assert text in proc.stdout
    for code in (cli.EXIT_OK, cli.EXIT_REQUEST_ERRORS, cli.EXIT_USAGE, cli.EXIT_ENDPOINT_UNAVAILABLE,
                 cli.EXIT_MODEL_NOT_SERVED, cli.EXIT_STORAGE, cli.EXIT_SHARD_CHANGED, cli.EXIT_INTERNAL):
        assert f"\n  {code} " in proc.stdout


@pytest.mark.service
def test_wrong_endpoint_is_one_line_exit_3_and_records_nothing(tmp_path, make_request):
    shard = write_shard(tmp_path, [make_request(f"a{i}") for i in range(5)])
    # --endpoint-wait 0: fail at once, not after the default wait for a starting endpoint (300 s,
    # the operator's and the pod's too: driver.config.DEFAULT_ENDPOINT_WAIT_S).
    proc = run_cli(*base_args(tmp_path, f"http://127.0.0.1:{free_port()}", shard), "--endpoint-wait", "0",
                   cwd=tmp_path)
    assert proc.returncode == cli.EXIT_ENDPOINT_UNAVAILABLE, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "cannot reach the inference endpoint" in proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "results").exists()  # nothing recorded: a re-run sends everything


@pytest.mark.service
def test_model_not_served_exit_4(tmp_path, fault_server, make_request):
    shard = write_shard(tmp_path, [make_request("a")])
    proc = run_cli(*base_args(tmp_path, fault_server.url, shard), "--model", "other", cwd=tmp_path)
    assert proc.returncode == cli.EXIT_MODEL_NOT_SERVED
    assert "is not served" in proc.stderr and "Traceback" not in proc.stderr
    assert fault_server.counts() == {}


@pytest.mark.service
def test_request_errors_exit_1_consistently_across_reruns(tmp_path, fault_server, make_request):
    records = [make_request(f"ok{i}") for i in range(8)] + [make_request("bad", "400")]
    shard = write_shard(tmp_path, records)
    first = run_cli(*base_args(tmp_path, fault_server.url, shard), "--model", "m", cwd=tmp_path)
    assert first.returncode == cli.EXIT_REQUEST_ERRORS, first.stderr
    outcome = json.loads(first.stdout.strip().splitlines()[-1])
    assert (outcome["completed"], outcome["failed"]) == (8, 1)
    again = run_cli(*base_args(tmp_path, fault_server.url, shard), cwd=tmp_path)
    assert again.returncode == cli.EXIT_REQUEST_ERRORS
    outcome = json.loads(again.stdout.strip().splitlines()[-1])
    assert (outcome["resumed"], outcome["resumed_failed"], outcome["completed"]) == (9, 1, 0)
    assert fault_server.count("bad") == 1


@pytest.mark.service
def test_all_answered_exit_0(tmp_path, fault_server, make_request):
    shard = write_shard(tmp_path, [make_request(f"ok{i}") for i in range(4)])
    proc = run_cli(*base_args(tmp_path, fault_server.url, shard), "--total", "4", cwd=tmp_path)
    assert proc.returncode == cli.EXIT_OK, proc.stderr
    changed = run_cli(*base_args(tmp_path, fault_server.url, shard), "--total", "5", cwd=tmp_path)
    assert changed.returncode == cli.EXIT_SHARD_CHANGED
    assert "planned with 5" in changed.stderr and "Traceback" not in changed.stderr


@pytest.mark.service
def test_bad_arguments_exit_2_with_the_reason(tmp_path):
    proc = run_cli("--shard-uri", "x", "--results-prefix", "y", "--endpoint", "http://h",
                   "--concurrency", "0", cwd=tmp_path)
    assert proc.returncode == cli.EXIT_USAGE
    assert "concurrency must be >= 1" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.service
def test_missing_shard_is_a_storage_error_exit_5(tmp_path, fault_server):
    proc = run_cli(*base_args(tmp_path, fault_server.url, str(tmp_path / "absent.jsonl")), cwd=tmp_path)
    assert proc.returncode == cli.EXIT_STORAGE
    assert "absent.jsonl" in proc.stderr and "Traceback" not in proc.stderr


def test_env_key_reaches_only_its_origin(tmp_path, fault_server, make_request, monkeypatch):
    from aibrix_operators.driver.cli import build_parser, config_from

    base = ["--shard-uri", "s", "--results-prefix", "r"]
    monkeypatch.setenv("OPENAI_API_KEY", "sk-planted-secret")
    monkeypatch.delenv("OPENAI_API_KEY_ORIGIN", raising=False)
    own = config_from(build_parser().parse_args([*base, "--endpoint", fault_server.url,
                                                 "--api-key-origin", fault_server.url]))
    assert own.headers()["Authorization"] == "Bearer sk-planted-secret"
    assert "sk-planted-secret" not in repr(own)
    foreign = config_from(build_parser().parse_args([*base, "--endpoint", "http://127.0.0.2:9",
                                                     "--api-key-origin", fault_server.url]))
    assert "Authorization" not in foreign.headers()
    unbound = config_from(build_parser().parse_args([*base, "--endpoint", fault_server.url]))
    assert "Authorization" not in unbound.headers()
    monkeypatch.setenv("OPENAI_API_KEY_ORIGIN", fault_server.url)
    from_env = config_from(build_parser().parse_args([*base, "--endpoint", fault_server.url]))
    assert from_env.headers()["Authorization"] == "Bearer sk-planted-secret"
