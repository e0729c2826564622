"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``
(chapter 10).

Every failure a client can see is an ``APIError`` with its HTTP status: malformed JSON or
bad fields 400, a missing or wrong API key 401 (with ``WWW-Authenticate: Bearer``), an
unknown model 404, a body too large 413, a body that is not JSON 415, overload 429 with a
``Retry-After`` header, an engine failure 500, a server that is shutting down (503 with
``Retry-After``) or whose engine has died 503. Every 4xx but 429 is an
``invalid_request_error``, as OpenAI types them. The official clients turn these into
``BadRequestError``, ``AuthenticationError``, ``NotFoundError``, ``RateLimitError``,
``InternalServerError``.
"""

from __future__ import annotations

import math
import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError


def error_type(status: int) -> str:
    """OpenAI's ``type`` for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


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
        self.retry_after = retry_after  # seconds, with 429 and a draining 503

    @property
    def reason(self) -> str:
        """The metrics' label for this rejection: its code, else its type."""
        return self.code or error_type(self.status)

    def body(self) -> dict:
        error = {"message": self.message, "type": error_type(self.status),
                 "param": self.param, "code": self.code}
        return {"error": error}

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:  # whole seconds, at least 1 (RFC 9110)
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        if self.status == 401:  # the scheme a client should use (RFC 9110)
            headers["WWW-Authenticate"] = "Bearer"
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
    if not first["loc"]:  # the body itself: a list, a string, a number
        return bad_request(f"The request body must be a JSON object: {first['msg']}",
                           code="invalid_body")
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
