"""What can go wrong for a submitter, as one line that says what to do, and its exit code.

Exit codes (documented in ``aibrix-batch --help`` and docs/batch-api.md):
0 done; 1 the batch failed, expired or was cancelled (or is not done when its results were
asked for); 2 usage: bad flags, a bad input file, an id or request the API refused;
3 the API is unreachable, timed out, failed (5xx), or refused the key; 4 a bug in the CLI.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class ExitCode(IntEnum):
    OK = 0
    BATCH_NOT_DONE = 1
    USAGE = 2
    UNREACHABLE = 3
    INTERNAL = 4


class ClientError(Exception):
    """An error the client raises itself; ``code`` is the CLI's exit code for it."""

    code = ExitCode.USAGE


class ConfigError(ClientError):
    """No or bad base URL / key / profile file."""


class InputFileError(ClientError):
    """The local input file cannot be a batch (missing, unreadable, first line not a request)."""


class PoolConfigError(ClientError):
    """A job-pool file or ``pool=`` value of the wrong shape (checked before anything is sent)."""


class StopRulesError(ClientError):
    """A stop rule out of range (docs/stop-rules.md), found before anything is sent."""


class BatchNotDone(ClientError):
    """The batch ended without completing, or has not ended when its results were asked for."""

    code = ExitCode.BATCH_NOT_DONE

    def __init__(self, message: str, batch: Any = None) -> None:
        super().__init__(message)
        self.batch = batch


def describe(exc: BaseException, base_url: str = "", key_source: str = "") -> tuple[ExitCode, str]:
    """(exit code, one-line message) for any exception; never a traceback."""
    import openai

    if isinstance(exc, ClientError):
        return exc.code, str(exc)
    if isinstance(exc, openai.APITimeoutError):
        return ExitCode.UNREACHABLE, (f"the Batch API at {base_url} did not answer in time; "
                                      "check the api-server, or raise --timeout")
    if isinstance(exc, openai.APIConnectionError):
        return ExitCode.UNREACHABLE, (f"cannot reach the Batch API at {base_url}; is the api-server "
                                      "running? (set the URL with --base-url or AIBRIX_BATCH_BASE_URL)")
    if isinstance(exc, openai.APIStatusError):
        message = _server_message(exc)
        status = exc.status_code
        if status in (401, 403):
            where = f" (from {key_source})" if key_source else ""
            return ExitCode.UNREACHABLE, (f"the Batch API refused the API key{where}: {message}; "
                                          "check --api-key / OPENAI_API_KEY")
        if status == 404:
            return ExitCode.USAGE, f"{message}; list your batches with: aibrix-batch list"
        if status == 413:
            return ExitCode.USAGE, f"{message}; split the input into smaller files"
        if status >= 500:
            return ExitCode.UNREACHABLE, (f"the Batch API failed ({status}): {message}; "
                                          "try again, or see the api-server log")
        return ExitCode.USAGE, message
    if isinstance(exc, OSError):
        name = f" {exc.filename}" if exc.filename else ""
        return ExitCode.USAGE, f"cannot use{name}: {exc.strerror or exc}; check the path"
    return ExitCode.INTERNAL, (f"internal error ({type(exc).__name__}: {exc}); "
                               "rerun with AIBRIX_BATCH_DEBUG=1 for a traceback")


def _server_message(exc: Any) -> str:
    # The SDK keeps OpenAI's error object ({"message", "type", "param", "code"}) as .body.
    body = exc.body if isinstance(exc.body, dict) else {}
    message = body.get("message") or (exc.response.reason_phrase if exc.response is not None else "")
    one_line = " ".join(str(message or f"HTTP {exc.status_code}").split())
    return one_line[:500]
