"""The router's command line: every flag also comes from ``ROUTER_<FLAG>`` (how the manifests
configure the image), a bad environment value is refused like a bad flag, and a flag given on the
command line wins over the environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aibrix_operators.router.cli import parse_args

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import os

    for name in [n for n in os.environ if n.startswith("ROUTER_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_each_flag_takes_its_value_from_router_flag_in_the_environment(clean_env, tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 40)
    for name, value in {
        "ROUTER_PORT": "9001", "ROUTER_DECODE": "http://a:1,http://b:2", "ROUTER_PREFILL_DNS": "p:8000",
        "ROUTER_AFFINITY_SLACK": "2.5", "ROUTER_IDLE_TIMEOUT_S": "7", "ROUTER_ONLINE_FIRST": "3",
        "ROUTER_PREFIX_AFFINITY": "off", "ROUTER_CLASS_HEADER": "x-class",
        "ROUTER_ADMIN_TOKEN_FILE": str(token),
    }.items():
        clean_env.setenv(name, value)
    args = parse_args([])
    assert (args.port, args.decode, args.prefill_dns) == (9001, ["http://a:1", "http://b:2"], "p:8000")
    assert (args.affinity_slack, args.idle_timeout_s, args.online_first) == (2.5, 7.0, 3)
    assert (args.prefix_affinity, args.class_header, args.admin_token_file) == ("off", "x-class", str(token))
    # A flag on the command line wins over the environment.
    assert parse_args(["--port", "7", "--online-first", "0"]).port == 7


def test_defaults_without_the_environment(clean_env) -> None:
    args = parse_args(["--decode", "http://d:1"])
    assert (args.host, args.port, args.health_interval_s, args.batch_wait_s) == ("0.0.0.0", 8000, 1.0, 5.0)
    assert args.admin_token_file is None and args.class_header is None and args.prefill_dns is None


def test_a_bad_environment_value_is_refused_naming_the_flag(clean_env, capsys) -> None:
    clean_env.setenv("ROUTER_MAX_CONNECTIONS", "many")
    with pytest.raises(SystemExit):
        parse_args(["--decode", "http://d:1"])
    assert "--max-connections: invalid int value: 'many'" in capsys.readouterr().err


def test_every_router_variable_the_manifests_set_is_a_flag(clean_env, capsys) -> None:
    names = set()
    for path in (REPO / "k8s").rglob("*.yaml"):
        names |= set(re.findall(r"\bROUTER_[A-Z_]+\b", path.read_text()))
    assert names, "the manifests configure the router through ROUTER_* variables"
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    flags = set(re.findall(r"--[a-z][a-z0-9-]*", capsys.readouterr().out))
    for name in sorted(names):
        assert "--" + name.removeprefix("ROUTER_").lower().replace("_", "-") in flags, name
