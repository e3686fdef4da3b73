"""Stop rules as a user sets them: checked once (validate, the Batch API), within the deployment's
token limit, with errors that say what is wrong and how to fix it (batch/stop_rules.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aibrix_operators.batch.error_codes import BatchFailure
from aibrix_operators.batch.job import validate_batch
from aibrix_operators.batch.stop_rules import StopReason, StopRules, StopTally
from aibrix_operators.batch_api.batches import check_stop_rules, dag_conf
from aibrix_operators.batch_api.errors import ApiError
from aibrix_operators.batch_api.settings import ModelRoute, load_settings
from aibrix_operators.settings.stop_rules import StopRulesSettingError, parse_max_batch_tokens
from aibrix_operators.storage import LocalStorage


@pytest.mark.parametrize(("rules", "says"), [
    ({"max_error_rate": 0}, "max_error_rate must be a fraction in (0, 1]"),
    ({"max_error_rate": 1.5}, "max_error_rate must be a fraction in (0, 1]"),
    ({"max_error_rate": "20%"}, "max_error_rate must be a fraction"),
    ({"max_error_rate": float("nan")}, "max_error_rate must be a fraction"),
    ({"max_error_rate": True}, "max_error_rate must be a fraction"),
    ({"error_rate_min_sample": 0}, "error_rate_min_sample must be a whole number >= 1"),
    ({"error_rate_min_sample": 2.5}, "error_rate_min_sample must be a whole number >= 1"),
    ({"max_total_tokens": 0}, "max_total_tokens must be a whole number of tokens >= 1"),
    ({"max_total_tokens": 1e9}, "max_total_tokens must be a whole number of tokens >= 1"),
    ({"max_errors": 3}, "unknown stop rule(s) ['max_errors']"),
    ([0.2], "stop rules must be an object"),
])
def test_a_bad_rule_is_refused_with_what_to_fix(rules: object, says: str) -> None:
    with pytest.raises(ValueError) as exc:
        StopRules.from_dict(rules)
    assert says in str(exc.value)


def test_rules_are_off_unless_asked_and_judge_over_the_minimum_sample() -> None:
    assert not StopRules.from_dict(None).active and not StopRules.from_dict({}).active
    rules = StopRules.from_dict({"max_error_rate": 0.2, "error_rate_min_sample": None})
    assert rules.error_rate_min_sample == 100  # null keeps the default
    assert rules.verdict(StopTally(answered=99, own_errors=99)) is None  # under the sample: no verdict
    assert rules.verdict(StopTally(answered=100, own_errors=20)) is None  # 20 %: at the rule, not over
    reason = rules.verdict(StopTally(answered=100, own_errors=21))
    assert reason is not None and reason.code == BatchFailure.MAX_ERROR_RATE_EXCEEDED
    assert "21 of the batch's first 100 answers" in reason.message
    budget = StopRules(max_total_tokens=1000)
    assert budget.verdict(StopTally(answered=5, input_tokens=600, output_tokens=399)) is None
    tripped = budget.verdict(StopTally(answered=5, input_tokens=600, output_tokens=400))
    assert tripped is not None and tripped.rule == "max_total_tokens"
    assert StopReason.from_bytes(reason.to_bytes()) == reason
    assert StopReason.from_bytes(b"garbage").rule == "unknown"  # an unreadable marker still stops


def test_the_deployments_token_limit_caps_every_batch() -> None:
    assert StopRules().within(5000).max_total_tokens == 5000  # no budget asked: the limit is its budget
    assert StopRules(max_total_tokens=4000).within(5000).max_total_tokens == 4000
    with pytest.raises(ValueError, match=r"limit of 5000 \(\[aibrix_batch\] max_batch_tokens\)"):
        StopRules(max_total_tokens=6000).within(5000)
    assert parse_max_batch_tokens(" 50_000_000 ") == 50_000_000 and parse_max_batch_tokens("") is None
    with pytest.raises(StopRulesSettingError, match=r"\[aibrix_batch\] max_batch_tokens = 'lots'"):
        parse_max_batch_tokens("lots")


def test_validate_fails_a_batch_with_bad_rules_and_keeps_good_ones(tmp_path: Path) -> None:
    storage = LocalStorage()
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "m", "messages": []}}) + "\n")
    report, batch = validate_batch(storage, str(inp), str(tmp_path / "bad"),
                                   stop_rules={"max_error_rate": 2})
    assert batch is None
    [error] = report.as_openai_errors()["data"]
    assert (error["code"], error["param"]) == ("invalid_stop_rules", "stop_rules")
    published = json.loads((tmp_path / "bad" / "batch.json").read_text())
    assert published["status"] == "failed" and published["errors"]["data"][0]["code"] == "invalid_stop_rules"
    _, batch = validate_batch(storage, str(inp), str(tmp_path / "ok"), stop_rules={"max_error_rate": 0.3},
                              max_batch_tokens=9000)
    assert batch is not None
    assert batch.stop_rules == {"max_error_rate": 0.3, "error_rate_min_sample": 100,
                                "max_total_tokens": 9000}
    _, plain = validate_batch(storage, str(inp), str(tmp_path / "plain"))
    assert plain is not None and plain.stop_rules is None  # no rule: nothing for the drivers to do


def test_the_batch_api_puts_the_rules_into_the_runs_conf_or_answers_400() -> None:
    settings = load_settings({"max_batch_tokens": "9000"}.get, Path("/r"))
    rules = check_stop_rules({"max_error_rate": 0.25}, settings.max_batch_tokens)
    conf = dag_conf(settings, "team-a", "batch_x", "file-x", "/r/in", "/v1/chat/completions", "24h", {},
                    None, ModelRoute(endpoint="http://127.0.0.1:1"), 0, "d", stop_rules=rules)
    assert conf["stop_rules"] == {"max_error_rate": 0.25, "error_rate_min_sample": 100,
                                  "max_total_tokens": 9000}
    assert check_stop_rules(None, None) is None
    with pytest.raises(ApiError) as exc:
        check_stop_rules({"max_total_tokens": 10_000}, settings.max_batch_tokens)
    assert (exc.value.status, exc.value.code, exc.value.param) == (400, "invalid_stop_rules", "stop_rules")
    assert "max_batch_tokens" in exc.value.message


def test_the_client_and_the_cli_check_rules_before_anything_is_sent() -> None:
    from aibrix_operators.client.batch_client import stop_rules_request
    from aibrix_operators.client.cli import _stop_rules, build_parser
    from aibrix_operators.client.errors import ExitCode, StopRulesError

    args = build_parser().parse_args(["create", "-i", "in.jsonl", "--max-error-rate", "0.2",
                                      "--max-total-tokens", "5000"])
    assert stop_rules_request(_stop_rules(args)) == {"max_error_rate": 0.2, "error_rate_min_sample": 100,
                                                     "max_total_tokens": 5000}
    assert _stop_rules(build_parser().parse_args(["create", "-i", "in.jsonl"])) is None
    with pytest.raises(StopRulesError, match="max_error_rate must be a fraction") as exc:
        stop_rules_request({"max_error_rate": 20})
    assert exc.value.code == ExitCode.USAGE


def test_a_pool_file_sets_stop_rules_and_the_flags_win(tmp_path) -> None:
    from aibrix_operators.batch.job_pool import load_pool_file
    from aibrix_operators.client.batch_client import stop_rules_request, with_pool_file_rules
    from aibrix_operators.client.cli import _stop_rules, build_parser
    from aibrix_operators.client.errors import StopRulesError

    path = tmp_path / "pool.yaml"
    path.write_text("pool:\n  max_workers: 2\nstop_rules:\n  max_error_rate: 0.3\n  max_total_tokens: 900\n")
    args = build_parser().parse_args(["create", "-i", "in.jsonl", "--config", str(path),
                                      "--max-total-tokens", "500"])  # fmt: skip
    assert stop_rules_request(with_pool_file_rules(args.config, _stop_rules(args))) == {
        "max_error_rate": 0.3, "error_rate_min_sample": 100, "max_total_tokens": 500}
    assert load_pool_file(path).as_params() == {"max_workers": 2}
    path.write_text("stop_rules:\n  max_error_rate: 0.3\n")  # rules alone: the pool keeps its defaults
    assert load_pool_file(path).as_params() == {}
    assert stop_rules_request(with_pool_file_rules(str(path), None))["max_error_rate"] == 0.3
    path.write_text("stop_rules:\n  max_eror_rate: 0.3\n")
    with pytest.raises(StopRulesError, match=rf"pool file {path}: stop_rules: unknown stop rule"):
        with_pool_file_rules(str(path), None)
