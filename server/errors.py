"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every failure.

Handlers raise ``APIError``; validation errors become 400s naming the offending field; anything
unexpected becomes a bare 500 (uvicorn logs the traceback; the client never sees it). A message
or ``param`` is cut to ``MAX_MESSAGE`` characters and made valid Unicode: an error never echoes a
huge input back, and text that cannot be encoded (a lone surrogate) cannot turn a 400 into a 500.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxpaged.async_engine import EngineDeadError, EngineOverloadedError, RequestFailedError
from jaxpaged.server.response_models import ErrorInfo, ErrorResponse

MAX_MESSAGE = 1000


def _safe(text: str) -> str:
    """``text`` cut to ``MAX_MESSAGE`` characters, unencodable characters escaped (``\\ud800``)."""
    if len(text) > MAX_MESSAGE:
        text = f"{text[:MAX_MESSAGE]}... ({len(text)} characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    """An error response: HTTP status plus OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = _safe(message)
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(
            message=message, type=type, param=None if param is None else _safe(param), code=code
        )
        self.headers = headers

    def to_response(self) -> JSONResponse:
        return JSONResponse(
            ErrorResponse(error=self.info).model_dump(), status_code=self.status, headers=self.headers
        )

    @classmethod
    def from_engine(
        cls, error: ValueError | EngineOverloadedError | EngineDeadError | RequestFailedError
    ) -> APIError:
        """The response for an error the engine raised on a request's behalf: a request it failed to
        process is a 500 (vLLM's), the others go on; a dead engine is a 503 for everyone."""
        if isinstance(error, ValueError):
            return cls(400, str(error), param=getattr(error, "param", None))
        if isinstance(error, EngineOverloadedError):
            return cls(503, str(error), type="server_error", code="overloaded", headers={"Retry-After": "1"})
        if isinstance(error, RequestFailedError):
            return cls(500, str(error), type="server_error")
        return cls(503, str(error), type="server_error", code="engine_dead")


def _validation_error(exc: RequestValidationError) -> APIError:
    """A 400 for the first problem pydantic found (the first of our own checks, if any failed), naming
    the field but not echoing its value."""
    errors = exc.errors()
    # Our own checks (a value error) say more than a union's other members (``prompt`` as a list of ids).
    err = next((e for e in errors if e["type"] == "value_error"), errors[0])
    loc = [str(part) for part in err["loc"][1:]]  # drop the leading "body"
    if err["type"] == "json_invalid":
        return APIError(400, "The request body is not valid JSON.")
    message = err["msg"].removeprefix("Value error, ")
    names = [part for part in loc if _names_field(part)]
    return APIError(
        400, f"{'.'.join(names)}: {message}" if names else message, param=names[0] if names else None
    )


def _names_field(part: str) -> bool:
    """A field name (snake_case) or an index; not a union member's label (``TokenizeChatRequest``,
    ``function-after[...]``), which names no field."""
    return part.isdigit() or (part.isidentifier() and part.islower())


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.to_response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).to_response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).to_response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        return APIError(
            500, "The server had an error while processing the request.", type="server_error"
        ).to_response()
