"""A request's body: JSON only, at most ``max_body_bytes``, parsed strictly (chapter 10).

The body is checked before it is read: a ``Content-Type`` other than JSON is a 415 (this
also stops a browser page from POSTing here cross-origin: a "simple" cross-origin request
can only send ``text/plain`` or form bodies), and a declared ``Content-Length`` over the
limit a 413. A body sent in chunks, without a length, is counted as it arrives and refused
the moment it passes the limit, so no client can make the server hold more than
``max_body_bytes`` of it.
"""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from nanovllm.serve.errors import APIError, from_validation_error

Model = TypeVar("Model", bound=BaseModel)


def is_json(content_type: str | None) -> bool:
    """``application/json`` (any parameters) or a ``+json`` type."""
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} "
                    "bytes).", "request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, once its type and size are known to be acceptable."""
    content_type = request.headers.get("content-type")
    if not is_json(content_type):
        raise APIError(415, f"The request body must be JSON (Content-Type: application/json), "
                       f"not {content_type or 'untyped'}.", "unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[Model], limit: int) -> Model:
    """The body as ``model``, or a 400/413/415 in OpenAI's shape."""
    try:
        return model.model_validate_json(await read_body(request, limit))
    except ValidationError as err:
        raise from_validation_error(err) from None
