"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

The official SDK turns the HTTP status into its typed exceptions (400
BadRequestError, 401 AuthenticationError, 404 NotFoundError, 409 ConflictError,
413 a plain APIStatusError; a bad query or body is a 400 too, never 422), and reads
``error.message`` for the exception text.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
    409: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
    500: "server_error", 503: "server_error",
}


class ApiError(Exception):
    """An error the API answers with; ``message`` is shown to the client, so it names no
    other tenant's data and no secret."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def not_found(kind: str, ident: str, param: str = "id") -> ApiError:
    # The same answer whether the object does not exist or belongs to another tenant.
    return ApiError(404, f"No such {kind}: {ident}", "not_found", param)


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code, param)
