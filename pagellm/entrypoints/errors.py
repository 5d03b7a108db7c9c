"""Errors the server returns, all in OpenAI's shape: ``{"error": {message, type, param, code}}``.

Handlers raise ``APIError`` (or let a ``ValueError`` from validation through); the app turns either
into a JSON response with the right status, so no bad input ever becomes a 500.
"""
from __future__ import annotations

from http import HTTPStatus
from typing import Any, Optional

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

# HTTP status -> the error "type" vLLM reports for it.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error with an HTTP status, raised anywhere in request handling."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.headers = headers


def error_body(message: str, status_code: int, param: Optional[str] = None) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(status_code) or HTTPStatus(status_code).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status_code}}


def error_response(
    message: str, status_code: int = 400, param: Optional[str] = None, headers: Optional[dict[str, str]] = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, param), status_code=status_code, headers=headers)


def api_error_response(exc: APIError) -> JSONResponse:
    return error_response(exc.message, exc.status_code, exc.param, exc.headers)


def format_validation_error(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """A one-line message naming each bad field, and the first field's name as ``param``."""
    messages: list[str] = []
    first_param: Optional[str] = None
    for err in exc.errors():
        # loc is ("body", field, index, ...); the leading "body" says nothing to an API user.
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        if err.get("type") == "json_invalid":
            messages.append(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        if not loc and err.get("type") in ("model_attributes_type", "dict_type", "missing"):
            messages.append("the request body must be a JSON object (sent as Content-Type: application/json)")
            continue
        where = ".".join(loc)
        if where and first_param is None:
            first_param = loc[0]
        messages.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    if not messages:
        messages.append("invalid request")
    return "; ".join(messages), first_param
