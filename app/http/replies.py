"""The JSON error body every route and error handler answers with."""

from __future__ import annotations

from typing import Any

from flask import Response, has_request_context, jsonify, request

# The Khala contract's mounts: at ENCORE_COMPAT_PREFIX (none by default) and under /api. Their errors carry
# the contract's `"status": "error"`; the contract's own views live in app/http/khala.py.
KHALA_BLUEPRINTS = ("khala", "khala_api")


def error(status: int, message: str, field: str | None = None) -> tuple[Response, int]:
    """A JSON error body naming the field; on the Khala-compatible routes also `"status": "error"`, which its
    frontend checks (without it a 401 or 5xx reads as accepted, and it polls /job/undefined forever)."""
    body: dict[str, Any] = {"error": message}
    if field:
        body["field"] = field
    if has_request_context() and request.blueprint in KHALA_BLUEPRINTS:
        body["status"] = "error"
    return jsonify(body), status


def job_not_found(job_id: str) -> tuple[Response, int]:
    """404 for a job that does not exist or that the request's tenant may not see (they read the same)."""
    return error(404, f"job {job_id} not found", "job_id")
