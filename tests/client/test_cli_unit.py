"""The CLI's and client's pure parts: argument parsing, where the URL and key come from,
exit codes and messages, progress and ETA formatting, the wait loop's pacing. No server."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types import Batch

from aibrix_operators.client import BatchClient, BatchNotDone, ConfigError, ExitCode
from aibrix_operators.client.cli import build_parser, main, parse_metadata
from aibrix_operators.client.errors import describe
from aibrix_operators.client.profile import normalize_base_url, resolve
from aibrix_operators.client.progress import RateMeter, TransferBar, batch_progress, format_duration


def batch(status: str = "in_progress", total: int = 1000, completed: int = 0, failed: int = 0) -> Batch:
    return Batch.model_validate({
        "id": "batch_x", "object": "batch", "endpoint": "/v1/chat/completions", "input_file_id": "file-a",
        "completion_window": "24h", "status": status, "created_at": 1,
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        "monitor_url": "http://ui/dags/batch_inference/runs/r"})


# ---------------------------------------------------------------------- parsing
def test_flags_parse_before_and_after_the_verb():
    p = build_parser()
    args = p.parse_args(["--json", "create", "--input", "in.jsonl", "--metadata", "a=1", "--metadata",
                         "b=x=y", "--window", "8h", "--wait", "--base-url", "http://h:1"])
    assert (args.verb, args.input, args.window, args.wait, args.json) == \
        ("create", "in.jsonl", "8h", True, True)
    assert args.base_url == "http://h:1" and parse_metadata(args.metadata) == {"a": "1", "b": "x=y"}
    # A flag before the verb is not undone by the verb's own (unset) default.
    assert build_parser().parse_args(["--api-key", "k", "list"]).api_key == "k"
    args = p.parse_args(["list", "--limit", "5", "--all"])
    assert (args.limit, args.all) == (5, True)
    assert p.parse_args(["results", "b", "-o", "o.jsonl", "--errors"]).errors
    with pytest.raises(Exception, match="KEY=VALUE"):
        parse_metadata(["novalue"])


def test_usage_errors_are_one_line_and_exit_2(capsys):
    for argv in (["create"], ["status"], ["frobnicate"], ["list", "--limit", "x"], []):
        with pytest.raises(SystemExit) as exc:
            main(argv, env={})
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err and "--help" in err, (argv, err)


@pytest.mark.parametrize("verb", ["create", "status", "list", "results", "cancel"])
def test_every_verb_has_help_with_an_example(verb, capsys):
    with pytest.raises(SystemExit) as exc:
        main([verb, "--help"], env={})
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "example:" in out and f"aibrix-batch {verb}" in out and "--json" in out


# ---------------------------------------------------------------------- where the URL and key come from
PROFILE = """\
default_profile: local
profiles:
  local: {base_url: "http://profile-host:8080", api_key: sk-profile}
  prod: {base_url: "https://prod/openai/v1", api_key: sk-prod}
"""


def test_flag_beats_env_beats_profile_for_each_value(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(PROFILE)
    env = {"AIBRIX_BATCH_CONFIG": str(cfg)}
    c = resolve(env=env)
    assert (c.base_url, c.api_key) == ("http://profile-host:8080/openai/v1", "sk-profile")
    assert c.api_key_source == f"profile local in {cfg}"
    env |= {"AIBRIX_BATCH_BASE_URL": "http://env-host:1", "OPENAI_API_KEY": "sk-env"}
    c = resolve(env=env)
    assert (c.base_url, c.api_key, c.api_key_source) == \
        ("http://env-host:1/openai/v1", "sk-env", "OPENAI_API_KEY")
    c = resolve(base_url="http://flag:2/custom", api_key="sk-flag", env=env)
    assert (c.base_url, c.api_key, c.base_url_source) == ("http://flag:2/custom", "sk-flag", "--base-url")
    # Each value on its own: the key from the environment, the URL from the chosen profile.
    c = resolve(profile="prod", env={"AIBRIX_BATCH_CONFIG": str(cfg), "OPENAI_API_KEY": "sk-env"})
    assert (c.base_url, c.api_key) == ("https://prod/openai/v1", "sk-env")
    c = resolve(env={"AIBRIX_BATCH_CONFIG": str(cfg), "AIBRIX_BATCH_PROFILE": "prod"})
    assert c.api_key == "sk-prod"


def test_profile_file_problems_say_what_to_fix(tmp_path):
    cfg = tmp_path / "config.yaml"
    with pytest.raises(ConfigError, match="--base-url, set AIBRIX_BATCH_BASE_URL"):
        resolve(env={"AIBRIX_BATCH_CONFIG": str(cfg)})  # no file, nothing set
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(profile="prod", env={"AIBRIX_BATCH_CONFIG": str(cfg)})
    cfg.write_text(PROFILE)
    with pytest.raises(ConfigError, match=r"'staging' is not in .*profiles: local, prod"):
        resolve(profile="staging", env={"AIBRIX_BATCH_CONFIG": str(cfg)})
    cfg.write_text("profiles: [unclosed\n")
    with pytest.raises(ConfigError, match="line 2 is not valid YAML"):
        resolve(env={"AIBRIX_BATCH_CONFIG": str(cfg)})
    cfg.write_text("base_url: http://h\napi_key: k\nbase_ulr: typo\n")
    with pytest.raises(ConfigError, match="unknown profile keys"):
        resolve(env={"AIBRIX_BATCH_CONFIG": str(cfg)})
    with pytest.raises(ConfigError, match="not an http"):
        normalize_base_url("127.0.0.1:8080")
    assert normalize_base_url("http://h:8080/") == "http://h:8080/openai/v1"


# ---------------------------------------------------------------------- exit codes and messages
def _status_error(cls: type, status: int, message: str) -> Exception:
    response = httpx.Response(status, request=httpx.Request("GET", "http://h/openai/v1/batches/x"))
    return cls(message, response=response, body={"message": message, "type": "x", "code": None})


def test_errors_map_to_exit_codes_and_one_line():
    request = httpx.Request("GET", "http://h")
    cases = [
        (_status_error(openai.AuthenticationError, 401, "invalid API key"), ExitCode.UNREACHABLE, "API key"),
        (_status_error(openai.PermissionDeniedError, 403, "no"), ExitCode.UNREACHABLE, "API key"),
        (openai.APIConnectionError(request=request), ExitCode.UNREACHABLE, "cannot reach"),
        (openai.APITimeoutError(request=request), ExitCode.UNREACHABLE, "did not answer"),
        (_status_error(openai.InternalServerError, 500, "internal error"), ExitCode.UNREACHABLE, "try again"),
        (_status_error(openai.NotFoundError, 404, "no batch batch_x"), ExitCode.USAGE, "aibrix-batch list"),
        (_status_error(openai.BadRequestError, 400, "bad\nwindow"), ExitCode.USAGE, "bad window"),
        (BatchNotDone("batch x failed"), ExitCode.BATCH_NOT_DONE, "failed"),
        (ConfigError("no API key"), ExitCode.USAGE, "no API key"),
        (FileNotFoundError(2, "No such file or directory", "in.jsonl"), ExitCode.USAGE, "in.jsonl"),
        (ZeroDivisionError("boom"), ExitCode.INTERNAL, "AIBRIX_BATCH_DEBUG"),
    ]
    for exc, code, words in cases:
        got, message = describe(exc, "http://h/openai/v1", "OPENAI_API_KEY")
        assert (got, "\n" in message) == (code, False), (exc, got, message)
        assert words in message, (exc, message)


def test_batch_exit_codes(monkeypatch, capsys):
    """status: 0 while running or completed, 1 once failed, expired or cancelled."""
    for status, code in (("in_progress", 0), ("completed", 0), ("failed", 1), ("expired", 1),
                         ("cancelled", 1)):
        monkeypatch.setattr(BatchClient, "retrieve", lambda self, _id, s=status: batch(s))
        assert main(["status", "batch_x", "--json"], env={"AIBRIX_BATCH_BASE_URL": "http://h",
                                                          "OPENAI_API_KEY": "k"}) == code, status
        assert '"monitor_url": "http://ui/' in capsys.readouterr().out


# ---------------------------------------------------------------------- progress
def test_durations_and_rate_and_eta():
    assert [format_duration(s) for s in (0, 59.4, 61, 3599, 3720, None, -1)] == \
        ["0s", "59s", "1m01s", "59m59s", "1h02m", "?", "?"]
    now = [0.0]
    meter = RateMeter(window_s=60, clock=lambda: now[0])
    meter.observe(0)
    assert meter.rate() is None and meter.eta(1000) is None
    now[0] = 10.0
    meter.observe(100)  # 10 req/s
    assert meter.rate() == pytest.approx(10.0) and meter.eta(1000) == pytest.approx(90.0)
    line = batch_progress(batch(completed=95, failed=5), meter)
    assert line == ("batch_x  in_progress  [##......................]  100/1000  10%  10.0 req/s  "
                    "ETA 1m30s, 5 failed")
    # The window slides: an old fast start does not hide a stall.
    for t in range(11, 200, 10):
        now[0] = float(t)
        meter.observe(100)
    assert meter.rate() == 0.0 and meter.eta(1000) is None
    done = batch_progress(batch("completed", completed=1000), meter)
    assert "1000/1000  100%" in done and "ETA" not in done


def test_transfer_bar_draws_only_on_a_tty(tmp_path):
    import io

    now = [0.0]
    quiet = io.StringIO()
    TransferBar("uploading x", 100, stream=quiet, enabled=False, clock=lambda: now[0]).update(50)
    assert quiet.getvalue() == ""
    bar = TransferBar("uploading x", 200_000_000, stream=io.StringIO(), enabled=True, clock=lambda: now[0])
    now[0] = 2.0
    bar.update(100_000_000)
    assert bar.line() == "uploading x  [############............]  100.0 MB/200.0 MB  50.0 MB/s  ETA 2s"


def test_wait_polls_at_most_once_a_second(monkeypatch):
    seen = iter(["validating", "in_progress", "in_progress", "completed"])
    monkeypatch.setattr(BatchClient, "retrieve", lambda self, _id: batch(next(seen)))
    sleeps: list[float] = []
    progress: list[str] = []
    client = BatchClient("http://h", "k")
    final = client.wait("batch_x", on_progress=lambda b: progress.append(b.status), poll_s=0.01,
                        sleep=sleeps.append)
    assert final.status == "completed"
    assert progress == ["validating", "in_progress", "in_progress", "completed"]
    assert len(sleeps) == 3 and all(0.9 < s <= 1.0 for s in sleeps), sleeps
    assert client.openai.base_url == "http://h/openai/v1/"  # the SDK client, exposed as is
