"""The server's errors as OpenAI's API gives them: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from starlette.responses import JSONResponse

__all__ = ["APIError"]


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
             500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None, *, kind: str | None = None,
                 **extra) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind, self.extra = kind, extra  # llama-server's own error types carry more fields

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind or self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.status, **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)
