"""The CLI's entry point (``main``, and ``python -m aibrix_operators.client`` where the process
boundary matters) against a real HTTP server: tests/client/batch_api_stub.py, served from a
thread. What a shell user and a script see: stdout, stderr, the exit code, the files left."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aibrix_operators.client import BatchClient, InputFileError
from aibrix_operators.client.cli import MAIN_HELP, main
from aibrix_operators.client.profile import resolve
from aibrix_operators.client.progress import batch_progress, request_tally
from tests.client.batch_api_stub import BATCH_ID, KEY, Stub, line, served_in_thread

REPO = Path(__file__).resolve().parents[2]
WIDTH = 100  # bytes per output line the stub sends


@pytest.fixture
def stub() -> Iterator[Stub]:
    with served_in_thread(Stub(lines=3, width=WIDTH, status="completed")) as server:
        yield server


def url(server: Stub) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def closed_port_url() -> str:
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def env_for(base_url: str, key: str, tmp_path: Path) -> dict[str, str]:
    return {"AIBRIX_BATCH_BASE_URL": base_url, "OPENAI_API_KEY": key,
            "AIBRIX_BATCH_CONFIG": str(tmp_path / "no-profile.yaml")}


def cli(capsys, base_url: str, tmp_path: Path, *argv: str, key: str = KEY) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv), env=env_for(base_url, key, tmp_path))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_process(base_url: str, tmp_path: Path, *argv: str, key: str = KEY) -> subprocess.CompletedProcess:
    env = dict(os.environ) | env_for(base_url, key, tmp_path)
    env.pop("AIBRIX_BATCH_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "aibrix_operators.client", *argv], capture_output=True,
                          text=True, env=env, timeout=120)


def request(custom_id: object = "r1", model: str = "m", **over: object) -> dict:
    r = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}}
    if custom_id is None:
        del r["custom_id"]
    return r | over


def write_lines(path: Path, *lines: object) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# ---------------------------------------------------------------------- results -o: the part file
def test_results_never_write_through_a_link_at_the_part_name(stub, tmp_path, capsys):
    """A link at the old predictable part name (FILE.part) pointing at someone's file: the
    download neither writes through it nor moves it onto FILE."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out.jsonl"
    link = tmp_path / "out.jsonl.part"
    link.symlink_to(victim)
    code, stdout, stderr = cli(capsys, url(stub), tmp_path, "results", BATCH_ID, "-o", str(out))
    assert code == 0, stderr
    assert victim.read_text() == "precious\n"
    assert not out.is_symlink() and out.read_bytes() == b"".join(line(i, WIDTH) for i in range(3))
    assert link.is_symlink() and os.readlink(link) == str(victim)  # left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.part", "victim.txt"]
    assert "wrote 3 output lines" in stdout


def test_a_failed_download_leaves_no_part_file_and_no_target(stub, tmp_path):
    stub.lines = 20_000  # 2 MB: several chunks, the failure comes mid-file
    out = tmp_path / "out.jsonl"

    def fail(done: int) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        BatchClient(url(stub), KEY).download(BATCH_ID, out, on_progress=fail)
    assert list(tmp_path.iterdir()) == []


def test_results_to_a_link_replace_the_link_not_its_target(stub, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out.jsonl"
    out.symlink_to(victim)
    code, _, stderr = cli(capsys, url(stub), tmp_path, "results", BATCH_ID, "-o", str(out))
    assert code == 0, stderr
    assert victim.read_text() == "precious\n" and not out.is_symlink() and out.stat().st_size == 3 * WIDTH


# ---------------------------------------------------------------------- the key stays out of reprs
def test_connection_repr_and_str_hold_no_api_key(tmp_path):
    key = "sk-very-secret-0123456789"
    conn = resolve(base_url="http://h:1", api_key=key, env={"AIBRIX_BATCH_CONFIG": str(tmp_path / "x")})
    assert conn.api_key == key
    for text in (repr(conn), str(conn), f"{conn}", f"{conn!r}", repr([conn]), repr({"c": conn})):
        assert key not in text and "very-secret" not in text, text
    assert "api_key_source='--api-key'" in repr(conn) and "http://h:1/openai/v1" in repr(conn)


# ---------------------------------------------------------------------- list: nothing before the first page
@pytest.mark.parametrize("as_json", [True, False], ids=["json", "table"])
def test_list_that_fails_writes_nothing_to_stdout(stub, tmp_path, capsys, as_json):
    flags = ["--json"] if as_json else []
    code, out, err = cli(capsys, url(stub), tmp_path, "list", *flags, key="sk-wrong")
    assert (code, out) == (3, ""), (code, out, err)
    assert err.count("\n") == 1 and "refused the API key" in err
    closed = closed_port_url()
    code, out, err = cli(capsys, closed, tmp_path, "list", *flags)
    assert (code, out) == (3, ""), (code, out, err)
    assert err.count("\n") == 1 and "cannot reach" in err and closed in err


def test_list_json_is_one_json_array(stub, tmp_path, capsys):
    code, out, err = cli(capsys, url(stub), tmp_path, "list", "--json")
    assert code == 0, err
    assert [b["id"] for b in json.loads(out)] == [BATCH_ID]
    code, out, _ = cli(capsys, url(stub), tmp_path, "list")
    header, row = out.splitlines()
    assert header.startswith("ID ") and row.startswith(BATCH_ID) and "3/3" in row


@pytest.mark.service
def test_list_json_of_the_real_entry_point_with_a_wrong_key(stub, tmp_path):
    proc = cli_process(url(stub), tmp_path, "--json", "list", key="sk-wrong")
    assert (proc.returncode, proc.stdout) == (3, ""), proc
    assert proc.stderr.startswith("aibrix-batch list: error:") and proc.stderr.count("\n") == 1


# ---------------------------------------------------------------------- create: checked before upload
BAD_LINES = (request("a"), request(None), request("a"), "{not json", request("b", method="GET"))


@pytest.mark.parametrize("wait", [False, True], ids=["no-wait", "wait"])
def test_create_with_bad_lines_exits_2_and_uploads_nothing(stub, tmp_path, capsys, wait):
    path = write_lines(tmp_path / "in.jsonl", *BAD_LINES)
    code, out, err = cli(capsys, url(stub), tmp_path, "create", "--input", str(path),
                         *(["--wait"] if wait else []))
    assert (code, out, stub.uploaded) == (2, "", []), (code, out, err)
    assert err.startswith(f"aibrix-batch create: error: {path} is not a valid batch file, so nothing was "
                          "uploaded; fix these and run again:\n")
    listed = err.splitlines()[1:]
    assert [re.match(r"  line (\d+): ", x).group(1) for x in listed] == ["2", "3", "4", "5"], err
    assert "missing_required_parameter: custom_id is missing; add it: each line is" in listed[0]
    assert "duplicate_custom_id" in listed[1] and "already appears on line 1" in listed[1]
    assert "invalid_json_line" in listed[2] and "one JSON object" in listed[2]
    assert "invalid_method" in listed[3] and "only 'POST'" in listed[3]


def test_create_of_a_good_file_uploads_it_once(stub, tmp_path, capsys):
    path = write_lines(tmp_path / "in.jsonl", request("a"), request("b"))
    code, out, err = cli(capsys, url(stub), tmp_path, "create", "--input", str(path))
    assert code == 0, err
    assert out.startswith(f"created {BATCH_ID}") and len(stub.uploaded) == 1


def test_deployment_rules_are_left_to_the_server(stub, tmp_path, capsys):
    """A second model may be a LoRA adapter of the first, and limits are the deployment's:
    the local check does not refuse what only the server can judge."""
    path = write_lines(tmp_path / "in.jsonl", request("a", model="base"), request("b", model="base-lora"))
    code, _, err = cli(capsys, url(stub), tmp_path, "create", "--input", str(path))
    assert code == 0, err
    assert len(stub.uploaded) == 1


def test_python_client_refuses_a_bad_file_before_upload(stub, tmp_path):
    path = write_lines(tmp_path / "in.jsonl", request("a"), request("a"))
    with pytest.raises(InputFileError, match=r"line 2: duplicate_custom_id: custom_id 'a' already appears"):
        BatchClient(url(stub), KEY).create_batch(input_file=path)
    assert stub.uploaded == []


@pytest.mark.service
def test_create_bad_file_through_the_real_entry_point(stub, tmp_path):
    path = write_lines(tmp_path / "in.jsonl", request("a"), "{not json")
    proc = cli_process(url(stub), tmp_path, "create", "--input", str(path), "--wait")
    assert (proc.returncode, proc.stdout, stub.uploaded) == (2, "", []), proc
    assert "line 2: invalid_json_line" in proc.stderr and "Traceback" not in proc.stderr


def test_readme_cli_exit_codes_are_the_help_text():
    """One truth: the README's CLI section shows the exit codes block of --help as it is."""
    help_block = MAIN_HELP[MAIN_HELP.index("exit codes:"):].split("\n\n")[0]
    readme = (REPO / "README.md").read_text()
    assert help_block in readme, help_block


# ---------------------------------------------------------------------- a cancelled batch is no mass failure
CANCELLED = {"request_counts": {"total": 200, "completed": 64, "failed": 136}}


def test_cancelled_batch_counts_are_not_a_mass_failure(stub, tmp_path, capsys):
    stub.extra = dict(CANCELLED)
    stub.status = "cancelled"
    code, out, err = cli(capsys, url(stub), tmp_path, "status", BATCH_ID)
    assert code == 1, err
    assert "200 total, 64 completed, 136 cancelled or failed" in out
    assert "136 failed" not in out and "code batch_cancelled" in out
    code, out, err = cli(capsys, url(stub), tmp_path, "status", BATCH_ID, "--watch")
    assert code == 1
    watched = err.splitlines()[0]
    assert "64/200 completed  32%, 136 cancelled or failed" in watched, watched
    assert "200/200" not in watched and "100%" not in watched and "136 failed" not in watched
    _, out, _ = cli(capsys, url(stub), tmp_path, "list")
    assert " 64/200 " in out.splitlines()[1]


def test_a_finalized_cut_short_batch_shows_unanswered_apart_from_failed(stub, tmp_path, capsys):
    """The server's count of requests the cancel left unanswered (aibrix_unanswered) splits them
    from the ones that failed on their own."""
    stub.extra = {**CANCELLED, "aibrix_unanswered": 134}
    stub.status = "cancelled"
    code, out, err = cli(capsys, url(stub), tmp_path, "status", BATCH_ID)
    assert code == 1, err
    assert "200 total, 64 completed, 134 not answered (cancelled), 2 failed" in out, out
    code, out, err = cli(capsys, url(stub), tmp_path, "status", BATCH_ID, "--watch")
    assert "64/200 completed  32%, 134 not answered (cancelled), 2 failed" in err.splitlines()[0]


def test_tally_rules():
    from openai.types import Batch

    def b(status: str, completed: int, failed: int, expires_at: int | None = None) -> Batch:
        return Batch.model_validate({
            "id": "batch_x", "object": "batch", "endpoint": "/v1/chat/completions", "input_file_id": "f",
            "completion_window": "24h", "status": status, "created_at": 1, "expires_at": expires_at,
            "request_counts": {"total": 200, "completed": completed, "failed": failed}})

    assert request_tally(b("expired", 150, 50)).failed_words() == "50 expired or failed"
    assert request_tally(b("cancelling", 10, 5)).cut_off_by == "cancelled"
    assert request_tally(b("completed", 190, 10)).failed_words() == "10 failed"
    # Still in progress past its window: expired lines are being written.
    assert request_tally(b("in_progress", 100, 60, expires_at=1000), now=1000).cut_off_by == "expired"
    assert request_tally(b("in_progress", 100, 60, expires_at=1000), now=999).cut_off_by is None
    assert batch_progress(b("completed", 190, 10)).endswith("200/200  100%, 10 failed")
    assert batch_progress(b("expired", 150, 50)).endswith("150/200 completed  75%, 50 expired or failed")
