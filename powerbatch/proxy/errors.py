"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, dict[str, str | None]]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    retry_after_s: int | None = None,
) -> web.Response:
    return json_error(error_body(status, message, code=code, param=param), status, retry_after_s)


def json_error(body: object, status: int, retry_after_s: int | None = None) -> web.Response:
    """An error body as the JSON answer, with Retry-After where the client should wait."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return web.json_response(body, status=status, headers=headers)
