"""APIError: an error answered in OpenAI's JSON shape, {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from typing import Any

from stateserve.entrypoints.openai_protocol import ErrorInfo, ErrorResponse


def _printable(text: str | None) -> str | None:
    """Text that can always be sent as UTF-8 JSON: a lone surrogate a client sent (and an error message quotes)
    becomes a backslash escape instead of failing the response with a 500."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        message, param = _printable(message), _printable(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()
