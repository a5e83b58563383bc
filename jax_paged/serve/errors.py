"""Errors answered in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.

`APIError` carries the status and the field (``param``) at fault; `bad_request` makes one from a
`ValueError` whose message starts with the field's name (the engine's and `SamplingParams`'s
messages do), `validation_error` from FastAPI's request validation.
"""

from __future__ import annotations

import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)")


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {
            400: "BadRequestError",
            401: "AuthenticationError",
            404: "NotFoundError",
        }.get(status, "InternalServerError")

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.status, self.message, self.param, self.kind), self.status
        )


def error_body(status: int, message: str, param: str | None, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def bad_request(e: Exception) -> APIError:
    """A request error from a `ValueError` whose message starts with the field's name."""
    message = str(e)
    m = _FIELD.match(message)
    return APIError(400, message, m.group(1) if m else None)


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('msg', '')}", None)
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "missing":
        msg = "field required"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    where = f"{param}: " if param else "the request body: "
    return APIError(400, f"{where}{msg}{more}", param)
