"""Where the CLI and client find the Batch API: flag > environment > profile file.

The profile file (``~/.config/aibrix-batch/config.yaml``, or the path in ``AIBRIX_BATCH_CONFIG``)
holds named profiles, like ``gh``'s hosts file or a kubeconfig's contexts::

    default_profile: local
    profiles:
      local:
        base_url: http://127.0.0.1:8080          # /openai/v1 is added when no path is given
        api_key: sk-my-key
      prod:
        base_url: https://airflow.example.com/openai/v1
        api_key: sk-prod-key

A file with only top-level ``base_url`` / ``api_key`` is one unnamed profile. Each of the two
values is resolved on its own, so ``OPENAI_API_KEY`` can supply the key while the URL comes
from the profile.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from aibrix_operators.client.errors import ConfigError

BASE_URL_ENV = "AIBRIX_BATCH_BASE_URL"
API_KEY_ENV = "OPENAI_API_KEY"  # the official SDK's variable: one key serves both
CONFIG_ENV = "AIBRIX_BATCH_CONFIG"
PROFILE_ENV = "AIBRIX_BATCH_PROFILE"
API_PATH = "/openai/v1"  # where the Airflow plugin mounts the Batch API


@dataclass(frozen=True)
class Connection:
    base_url: str
    # Never in repr/str: a Connection in a log line, a traceback's locals or a debugger shows
    # where the key came from (api_key_source), not the key.
    api_key: str = field(repr=False)
    # Where each value came from ("--base-url", "AIBRIX_BATCH_BASE_URL", "profile local in …"),
    # so an auth or connection error can say which setting to fix.
    base_url_source: str
    api_key_source: str


def config_path(env: Mapping[str, str] = os.environ) -> Path:
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]).expanduser()
    config_home = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config_home / "aibrix-batch" / "config.yaml"


def normalize_base_url(url: str) -> str:
    """``http://host:8080`` → ``http://host:8080/openai/v1``; a URL with a path is kept as given."""
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"base URL {url!r} is not an http(s) URL; "
                          f"use e.g. http://127.0.0.1:8080{API_PATH}")
    path = parts.path.rstrip("/") or API_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def load_profile(path: Path, name: str | None) -> tuple[dict[str, Any], str]:
    """The named (or default) profile of the file; ``({}, "")`` when there is no file."""
    import yaml

    try:
        text = path.read_text()
    except FileNotFoundError:
        if name:
            raise ConfigError(f"profile {name!r} asked for, but {path} does not exist; "
                              f"create it or set {CONFIG_ENV}") from None
        return {}, ""
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}; fix its permissions or set "
                          f"{CONFIG_ENV}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"{path}{line} is not valid YAML; fix it or set {CONFIG_ENV} to another "
                          "file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping with 'profiles:' (see aibrix-batch --help)")
    profiles = data.get("profiles")
    if profiles is None:
        if name:
            raise ConfigError(f"{path} has no profiles; remove --profile or add 'profiles: {{{name}: …}}'")
        return _profile_values(data, path), f"{path}"
    if not isinstance(profiles, dict):
        raise ConfigError(f"{path}: 'profiles' must be a mapping of name → {{base_url, api_key}}")
    chosen = name or data.get("default_profile") or "default"
    if chosen not in profiles:
        if not name and not data.get("default_profile"):
            return {}, ""  # profiles exist but none is chosen: flags and env must do
        known = ", ".join(sorted(map(str, profiles))) or "none"
        raise ConfigError(f"profile {chosen!r} is not in {path} (profiles: {known}); pick one with --profile")
    return _profile_values(profiles[chosen] or {}, path), f"profile {chosen} in {path}"


def _profile_values(entry: Any, path: Path) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise ConfigError(f"{path}: a profile must be a mapping with base_url and api_key")
    unknown = set(entry) - {"base_url", "api_key"}
    if unknown:
        raise ConfigError(f"{path}: unknown profile keys {sorted(unknown)}; allowed: base_url, api_key")
    return {k: str(v) for k, v in entry.items() if v is not None}


def resolve(base_url: str | None = None, api_key: str | None = None, profile: str | None = None,
            env: Mapping[str, str] = os.environ) -> Connection:
    """Flag, else environment, else the profile file, for each value on its own."""
    profile = profile or env.get(PROFILE_ENV) or None
    path = config_path(env)
    values, source = load_profile(path, profile)

    def pick(flag: str | None, flag_name: str, env_name: str, key: str) -> tuple[str | None, str]:
        if flag:
            return flag, flag_name
        if env.get(env_name):
            return env[env_name], env_name
        if values.get(key):
            return values[key], source
        return None, ""

    url, url_source = pick(base_url, "--base-url", BASE_URL_ENV, "base_url")
    key, key_source = pick(api_key, "--api-key", API_KEY_ENV, "api_key")
    if not url:
        raise ConfigError(f"no Batch API URL: pass --base-url, set {BASE_URL_ENV}, or add base_url to {path}")
    if not key:
        raise ConfigError(f"no API key: pass --api-key, set {API_KEY_ENV}, or add api_key to {path}")
    return Connection(normalize_base_url(url), key, url_source, key_source)
