"""OpenAI's error bodies (``{"error": {"message", "type", "param", "code"}}``) and the
refusals the routes raise."""

from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

from specjax._src.serve import events as events_lib


class ApiError(Exception):
    """An OpenAI-style error: ``status``, ``message``, ``type``, ``param``, ``code``, and the
    seconds to wait before a retry (``Retry-After``), where one helps."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        retry_after: Optional[int] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad(message: str, param: Optional[str] = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported")


def server_error() -> ApiError:
    return ApiError(
        500,
        "The server failed while answering this request; see its log for the request id.",
        type="server_error",
        code="internal_error",
    )


def too_long(what: str, param: str, capacity: int) -> ApiError:
    return bad(
        f"The {what} is longer than a slot holds ({capacity} tokens, prompt and completion together). "
        "Shorten it, or start the server with a larger --capacity.",
        param,
        "context_length_exceeded",
    )


def refusal(e: Exception) -> ApiError:
    """The answer to :class:`~specjax._src.serve.events.QueueFull` (429) or ``Closed`` (503)."""
    if isinstance(e, events_lib.QueueFull):
        return ApiError(429, str(e), type="rate_limit_error", code="queue_full", retry_after=1)
    return ApiError(503, str(e), type="server_error", code="shutting_down", retry_after=5)


def failure(event: events_lib.Failed) -> ApiError:
    """The answer to a request the scheduler could not serve."""
    if event.code == "invalid_request":
        return bad(event.message)
    if event.code == "shutting_down":
        return ApiError(503, event.message, type="server_error", code=event.code, retry_after=5)
    return ApiError(500, event.message, type="server_error", code=event.code)
