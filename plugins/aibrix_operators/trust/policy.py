"""Trust boundaries set by the deployment: what a DAG trigger may point the worker at.

Whoever may trigger a run chooses its params; the deployment chooses what a
worker may reach with its identity. A ``TrustPolicy`` (built from Airflow
config by ``trust/deployment.py``; this module imports no Airflow) lists:

* ``endpoints``: inference base URLs a free-form ``endpoint`` param may name —
  ``scheme://host[:port][/path]`` patterns, port ``*`` for any port;
* ``storage``: local directories and ``s3://bucket/prefix`` prefixes that
  ``input_uri``/``output_uri`` must lie under;
* ``aws_conn_ids`` / ``inference_conn_ids``: Airflow connections a trigger may
  name (``DEFAULT_CHAIN`` stands for "no connection": boto3's default
  credentials, i.e. the worker's own identity).

Every check raises ``TrustViolation`` naming the rule, before anything is
read or written. API keys never come from params: they come from an inference
connection and are bound to that connection's base URL (see ``under_base``).

An endpoint is a plain base URL that every party reads the same way: no query or
fragment (which would swallow the request path appended to it), no percent-escapes,
backslashes, control characters, dot or empty segments (which a server may resolve
to another path than the allow-list saw). Such a URL is refused, not normalised, so
the URL that was checked is byte for byte the URL that is sent.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from aibrix_operators.batch.error_codes import BatchFailure, CodedFailure
from aibrix_operators.storage import StorageError, has_control_characters, split_s3_uri

# Stands for "no aws_conn_id": boto3's default chain, the worker's own credentials.
DEFAULT_CHAIN = "<default>"
LOOPBACK_ENDPOINTS = ("http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class TrustViolation(CodedFailure):
    """A trigger asked for something the deployment's allow-list does not grant."""

    error_code, retryable = BatchFailure.REFUSED_BY_POLICY, False

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"refused by the allow-list rule {rule}: {message}")
        self.rule = rule


@dataclass(frozen=True)
class TrustPolicy:
    endpoints: tuple[str, ...]
    storage: tuple[str, ...]
    aws_conn_ids: tuple[str, ...]
    inference_conn_ids: tuple[str, ...]
    # Where the policy came from, for messages (e.g. "[aibrix_batch] in airflow.cfg").
    source: str = "the deployment"

    def check_endpoint(self, url: str) -> None:
        """A free-form endpoint (no API key goes to it) must match ``endpoints``."""
        try:
            scheme, host, port, path = _url_parts(url)
        except ValueError as exc:
            raise TrustViolation("allowed_endpoints", f"endpoint {url!r}: {exc}") from None
        for pattern in self.endpoints:
            if _endpoint_matches(pattern, scheme, host, port, path):
                return
        raise TrustViolation(
            "allowed_endpoints",
            f"endpoint {url!r} is not in {self.source}'s allowed_endpoints "
            f"({', '.join(self.endpoints) or 'none'})",
        )

    def check_storage(self, uri: str, param: str) -> None:
        """``uri`` (a file or a prefix) must lie under one of ``storage``."""
        if has_control_characters(uri):
            raise TrustViolation("allowed_storage", f"{param} {uri!r}: control characters are not accepted")
        if uri.startswith("s3://"):
            ok = any(_s3_under(uri, p) for p in self.storage if p.startswith("s3://"))
        elif "://" in uri and not uri.startswith("file://"):
            ok = False
        else:
            ok = any(_path_under(uri, p) for p in self.storage if "://" not in p or p.startswith("file://"))
        if not ok:
            raise TrustViolation(
                "allowed_storage",
                f"{param} {uri!r} is not under {self.source}'s allowed_storage "
                f"({', '.join(self.storage) or 'none'})",
            )

    def check_aws_conn(self, conn_id: str | None) -> None:
        name = conn_id or DEFAULT_CHAIN
        if name not in self.aws_conn_ids:
            what = (f"aws_conn_id {conn_id!r}" if conn_id
                    else "an empty aws_conn_id (the worker's own credentials)")
            raise TrustViolation(
                "allowed_aws_conn_ids",
                f"{what} is not in {self.source}'s allowed_aws_conn_ids "
                f"({', '.join(self.aws_conn_ids) or 'none'})",
            )

    def check_inference_conn(self, conn_id: str) -> None:
        if conn_id not in self.inference_conn_ids:
            raise TrustViolation(
                "allowed_inference_conn_ids",
                f"inference_conn_id {conn_id!r} is not in {self.source}'s allowed_inference_conn_ids "
                f"({', '.join(self.inference_conn_ids) or 'none'})",
            )

    def check_trigger(
        self,
        *,
        input_uri: str | None = None,
        output_uri: str | None = None,
        aws_conn_id: str | None = None,
        endpoint: str | None = None,
        inference_conn_id: str | None = None,
    ) -> None:
        """Everything a batch trigger names, output first (it decides where a refusal is recorded)."""
        if output_uri is not None:
            self.check_storage(output_uri, "output_uri")
            _refuse_links_in_output(output_uri)
        self.check_aws_conn(aws_conn_id)
        if input_uri is not None:
            self.check_storage(input_uri, "input_uri")
        if inference_conn_id:
            self.check_inference_conn(inference_conn_id)
        elif endpoint:
            self.check_endpoint(endpoint)


def local_development_policy(repo_root: Path) -> TrustPolicy:
    """What applies when the deployment set nothing: this checkout and loopback only."""
    return TrustPolicy(
        endpoints=LOOPBACK_ENDPOINTS,
        storage=(str(repo_root / "examples"), str(repo_root / ".work")),
        aws_conn_ids=(DEFAULT_CHAIN,),
        inference_conn_ids=(),
        source="the local-development default allow-list",
    )


def parse_list(text: str | None) -> tuple[str, ...] | None:
    """A config value: entries separated by commas or newlines; ``None`` when unset."""
    if text is None:
        return None
    return tuple(item.strip() for item in text.replace("\n", ",").split(",") if item.strip())


def origin(url: str) -> str:
    """``scheme://host:port`` with the default port made explicit: what an API key is bound to."""
    scheme, host, port, _ = _url_parts(url)
    return f"{scheme}://{host}:{port}"


def same_origin(a: str, b: str) -> bool:
    try:
        return origin(a) == origin(b)
    except ValueError:
        return False


def under_base(url: str, base: str) -> bool:
    """``url`` is ``base`` or below its path (on ``/`` boundaries), with the same origin."""
    try:
        scheme, host, port, path = _url_parts(url)
        b_scheme, b_host, b_port, b_path = _url_parts(base)
    except ValueError:
        return False
    if (scheme, host, port) != (b_scheme, b_host, b_port):
        return False
    prefix = b_path.rstrip("/")
    return not prefix or path.rstrip("/") == prefix or path.startswith(prefix + "/")


_PATH_CHARS = re.compile(r"[A-Za-z0-9._~/-]*")


def endpoint_form_problem(url: str) -> str | None:
    """Why ``url`` is not a plain base URL (see the module docstring), or ``None``."""
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        return "control characters or spaces are not accepted"
    if "?" in url or "#" in url:
        return ("an endpoint is a base URL with no query or fragment "
                "(the request path is appended to it)")  # fmt: skip
    if "%" in url or "\\" in url:
        return "percent-escapes and backslashes are not accepted; write the path plainly"
    if not url.isascii():
        return "non-ASCII characters are not accepted (write an IDN host in its xn-- form)"
    path = urlsplit(url).path
    if not _PATH_CHARS.fullmatch(path):
        # An allow-list, not more refusals: ';' (".. ;" is '..' to Tomcat, Jetty, Spring and
        # gateways built on them) and every other sub-delimiter mean something to some server.
        return "path characters other than letters, digits, '-', '.', '_', '~' and '/' are not accepted"
    if any(segment in (".", "..") for segment in path.split("/")):
        return "'.' and '..' path segments are not accepted"
    if "//" in path:
        return "empty path segments ('//') are not accepted"
    return None


def _url_parts(url: str) -> tuple[str, str, int, str]:
    problem = endpoint_form_problem(url)
    if problem:
        raise ValueError(problem)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError("not an http(s):// URL")
    # user:pass@host hides the real host from a reader; never needed for an inference server.
    if "@" in parts.netloc:
        raise ValueError("credentials in the URL are not accepted")
    host = (parts.hostname or "").lower()
    if not host:
        raise ValueError("no host")
    port = parts.port or _DEFAULT_PORTS[scheme]  # raises ValueError on a bad port
    if ":" in host:
        host = f"[{host}]"
    return scheme, host, port, parts.path or "/"


def endpoint_matches(pattern: str, url: str) -> bool:
    """Whether ``url`` falls under ``pattern`` (the syntax of ``allowed_endpoints``)."""
    try:
        scheme, host, port, path = _url_parts(url)
    except ValueError:
        return False
    return _endpoint_matches(pattern, scheme, host, port, path)


def _endpoint_matches(pattern: str, scheme: str, host: str, port: int, path: str) -> bool:
    any_port = False
    if pattern.rstrip("/").endswith(":*") or ":*/" in pattern:
        any_port = True
        pattern = pattern.replace(":*", "", 1)
    try:
        p_scheme, p_host, p_port, p_path = _url_parts(pattern)
    except ValueError:
        return False
    if (p_scheme, p_host) != (scheme, host) or (not any_port and p_port != port):
        return False
    prefix = p_path.rstrip("/")
    return not prefix or path == prefix or path.startswith(prefix + "/")


def _refuse_links_in_output(uri: str) -> None:
    """A local output tree holds no symbolic links: the root is resolved by the check, but the
    pipeline writes below it (``_work/``, ``shards/``, ``CANCEL``), and a link there would carry
    those writes out of the allowed directories."""
    if uri.startswith("s3://") or ("://" in uri and not uri.startswith("file://")):
        return
    root = uri[len("file://"):] if uri.startswith("file://") else uri
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in (*dirnames, *filenames):
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                raise TrustViolation(
                    "allowed_storage",
                    f"output_uri {uri!r} holds a symbolic link ({path}); writes below the output "
                    "location never follow links: remove it or choose another output_uri",
                )


def _path_under(uri: str, allowed: str) -> bool:
    # realpath resolves ".." and symlinks, so neither can walk out of an allowed directory.
    path = os.path.realpath(uri[len("file://"):] if uri.startswith("file://") else uri)
    root = os.path.realpath(allowed[len("file://"):] if allowed.startswith("file://") else allowed)
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # different drives, or relative against absolute
        return False


def _s3_under(uri: str, allowed: str) -> bool:
    # The same parser storage uses to address the object: what is checked is what is used.
    try:
        bucket, key = split_s3_uri(uri)
        a_bucket, a_prefix = split_s3_uri(allowed)
    except StorageError:
        return False
    if bucket != a_bucket:
        return False
    # A prefix matches on "/" boundaries: s3://b/team does not grant s3://b/team-other.
    a_prefix = a_prefix.strip("/")
    if any(seg in ("..", ".") for seg in key.split("/")):
        return False
    return not a_prefix or key.strip("/") == a_prefix or key.startswith(a_prefix + "/")


def describe(policy: TrustPolicy) -> Iterable[str]:
    """The policy as log lines (no secrets in it: only names and prefixes)."""
    yield f"allow-list from {policy.source}:"
    yield f"  endpoints: {', '.join(policy.endpoints) or 'none'}"
    yield f"  storage: {', '.join(policy.storage) or 'none'}"
    yield f"  aws_conn_ids: {', '.join(policy.aws_conn_ids) or 'none'}"
    yield f"  inference_conn_ids: {', '.join(policy.inference_conn_ids) or 'none'}"


def connection_url(host: str | None, schema: str | None = None, port: int | None = None) -> str:
    """Base URL of an HTTP connection (host may carry its own scheme, as Airflow's UI allows)."""
    if not host:
        raise TrustViolation("inference_conn_id", "the inference connection has no host")
    if "://" in host:
        url = host.rstrip("/")
        if port and urlsplit(url).port is None:
            parts = urlsplit(url)
            url = f"{parts.scheme}://{parts.netloc}:{port}{parts.path}".rstrip("/")
        return url
    scheme = schema if schema in _DEFAULT_PORTS else "http"
    return f"{scheme}://{host}:{port}" if port else f"{scheme}://{host}"
