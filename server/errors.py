"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every failure.

Handlers raise ``APIError``; validation errors become 400s naming the offending field; anything
unexpected becomes a bare 500 (uvicorn logs the traceback; the client never sees it).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxpaged.async_engine import EngineDeadError, EngineOverloadedError
from jaxpaged.server.protocol import ErrorInfo, ErrorResponse

class APIError(Exception):
    """An error response: HTTP status plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def to_response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status,
                            headers=self.headers)

    @classmethod
    def from_engine(cls, error: ValueError | EngineOverloadedError | EngineDeadError) -> APIError:
        """The response for an error the engine raised on a request's behalf."""
        if isinstance(error, ValueError):
            return cls(400, str(error))
        if isinstance(error, EngineOverloadedError):
            return cls(503, str(error), type="server_error", code="overloaded", headers={"Retry-After": "1"})
        return cls(503, str(error), type="server_error", code="engine_dead")


def _validation_error(exc: RequestValidationError) -> APIError:
    """A 400 for the first problem pydantic found, naming the field but not echoing its value."""
    err = exc.errors()[0]
    loc = [str(part) for part in err["loc"][1:]]            # drop the leading "body"
    param = loc[0] if loc else None
    if err["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {'.'.join(loc)}", param=param)
    if err["type"] == "json_invalid":
        return APIError(400, "The request body is not valid JSON.")
    message = err["msg"].removeprefix("Value error, ")
    return APIError(400, f"{'.'.join(loc)}: {message}" if loc else message, param=param)


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
        return APIError(500, "The server had an error while processing the request.",
                        type="server_error").to_response()
