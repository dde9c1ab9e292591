"""OpenAI/SGLang-shaped error bodies and the app-wide handlers that produce them.

SGLang's OpenAI routes answer failures with a top-level error object,
`{"object": "error", "message": ..., "type": "BadRequestError", "param": null, "code": 400}`,
and, once a stream has started, with an SSE event `{"error": {...}}` followed by
`data: [DONE]`. Request-validation failures are 400s of the same shape, not FastAPI's 422.
This module builds those bodies; it does not decide when a request fails.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.responses import Response

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def error_body(message: str, status: int = 400, error_type: str | None = None) -> dict[str, Any]:
    """The error object for `status` (SGLang's ErrorResponse)."""
    if error_type is None:
        error_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    return {
        "object": "error",
        "message": message,
        "type": error_type,
        "param": None,
        "code": status,
    }


def error_response(body: dict[str, Any], status: int | None = None) -> JSONResponse:
    """A JSON response carrying an error object; the status defaults to the body's `code`."""
    code = status if status is not None else int(body.get("code") or 500)
    assert code >= 400, f"an error response needs an error status, got {code}"
    return JSONResponse(body, status_code=code)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request body"


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(error_body(_validation_message(exc), 400))


def install_error_handlers(app: FastAPI) -> None:
    """Make body-validation failures 400s with an OpenAI error object."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
