"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``
(chapter 10).

Every failure a client can see is an ``APIError`` with its HTTP status: malformed JSON or
bad fields 400, a missing or wrong API key 401, an unknown model 404, overload 429 with a
``Retry-After`` header, an engine failure 500, a server that is shutting down or whose
engine has died 503. The official clients turn these into ``BadRequestError``,
``AuthenticationError``, ``NotFoundError``, ``RateLimitError``, ``InternalServerError``.
"""

from __future__ import annotations

import math
import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after = retry_after  # seconds, with 429

    def body(self) -> dict:
        error = {"message": self.message, "type": TYPES.get(self.status, "server_error"),
                 "param": self.param, "code": self.code}
        return {"error": error}

    def response(self) -> JSONResponse:
        headers = None
        if self.retry_after is not None:  # whole seconds, at least 1 (RFC 9110)
            headers = {"Retry-After": str(max(1, math.ceil(self.retry_after)))}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, code, param)


def from_validation_error(err: ValidationError) -> APIError:
    """A 400 naming the first bad field (pydantic lists every branch of a union: one is
    enough to say what is wrong)."""
    first = err.errors()[0]
    if first["type"] == "json_invalid":
        message = f"The request body is not valid JSON: {first['msg']}"
        return bad_request(message, code="json_invalid")
    fields = []
    for part in first["loc"]:
        if isinstance(part, str) and _is_type_name(part):
            break  # the rest names a branch of a union
        fields.append(str(part))
    param = ".".join(fields) or None
    if first["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'", param)
    return bad_request(f"Invalid value for '{param}': {first['msg']}", param)


def from_value_error(err: ValueError) -> APIError:
    """A 400 from the engine's own checks (``SamplingParams``, the prompt)."""
    message = str(err)
    match = re.match(r"SamplingParams\.(\w+)", message)
    param = match.group(1) if match else None
    code = "context_length_exceeded" if "max_model_len" in message else None
    return bad_request(message, param, code)


def _is_type_name(part: str) -> bool:
    """pydantic names union branches in ``loc`` by their type, e.g. ``list[int]``."""
    return part in ("str", "int", "float", "bool") or "[" in part
