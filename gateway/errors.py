"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, vLLM's wording.

Every failure the gateway reports is an `APIError`; handlers registered in `install_handlers`
turn it (and FastAPI's own validation and HTTP errors) into that shape, so the official
`openai` SDK raises its matching exception class (NotFoundError, BadRequestError, ...).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """Every error body (`APIError.body`), as the OpenAPI schema states it (gateway/openapi.py)."""

    error: ErrorDetail


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status_code: int = 400,
        *,
        param: str | None = None,
        retry_after_s: int | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.retry_after_s = retry_after_s
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status_code, HTTPStatus(self.status_code).phrase.replace(" ", ""))

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status_code,
            }
        }

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param=param)


# How much of an unknown model's name a 404 repeats: enough to spot a typo, not a megabyte.
MAX_ECHOED_MODEL_CHARS = 256


def model_not_found(model: str | None) -> APIError:
    name = str(model)
    if len(name) > MAX_ECHOED_MODEL_CHARS:
        name = f"{name[:MAX_ECHOED_MODEL_CHARS]}... ({len(name)} characters)"
    return APIError(f"The model `{name}` does not exist.", 404, param="model")


# What a client is told when a decode fails; the decode's own words only go to the log.
DECODE_FAILED = "The model server failed to run this request. Retry the request."
DECODE_FAILED_MID_STREAM = (
    "The model server failed while generating this response; any output already sent is "
    "incomplete. Retry the request."
)
DECODE_BUSY_MID_STREAM = "The model server ran out of capacity for this request; retry later."


def hidden_failure(
    message: str, detail: str, status_code: int = 500, retry_after_s: int | None = None
) -> APIError:
    """An error whose client-facing `message` says what failed and what to do, while `detail`
    (gRPC status names, peer addresses, `debug_error_string`, an engine exception's text) only
    reaches the gateway's log: the client cannot act on it, an attacker could map the cluster."""
    logger.warning("%s Detail: %s", message, detail)
    return APIError(message, status_code, retry_after_s=retry_after_s)


def _format_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "Invalid request."


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI clients expect 400 BadRequestError.
        return bad_request(_format_validation(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(str(exc.detail), exc.status_code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error: %s", type(exc).__name__)
        return APIError("Internal server error.", 500).response()
