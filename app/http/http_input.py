"""Bounded reading of request bodies: a JSON body is refused (400, naming `body`) before it is parsed when
it is too large or nested too deeply, so no client can make the parser recurse or allocate without bound."""

from __future__ import annotations

import json
import re
from typing import Any

from flask import Request

MAX_JSON_BYTES = 1 << 20  # far above any valid body (lyrics are capped at ENCORE_MAX_LYRICS_CHARS)
MAX_JSON_DEPTH = 32  # valid bodies are flat objects
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


class BodyError(ValueError):
    def __init__(self, message: str):
        super().__init__(message)
        self.field = "body"


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (strings skipped)."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub(b'""', raw)):
        depth += 1 if match.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    return deepest


def json_object(request: Request) -> dict[str, Any]:
    """The request's JSON object, or BodyError saying why not."""
    if request.content_length is not None and request.content_length > MAX_JSON_BYTES:
        raise BodyError(f"body: larger than {MAX_JSON_BYTES} bytes")
    raw = request.get_data(cache=True)
    if len(raw) > MAX_JSON_BYTES:
        raise BodyError(f"body: larger than {MAX_JSON_BYTES} bytes")
    if not request.is_json:
        raise BodyError("body: expected a JSON object (Content-Type: application/json)")
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise BodyError(f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # ValueError also covers integers past Python's digit limit
        raise BodyError("body: not valid JSON") from None
    if not isinstance(body, dict):
        raise BodyError("body: expected a JSON object (Content-Type: application/json)")
    return body
