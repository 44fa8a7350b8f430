"""What describes the service to people and tools: the operator/user page and the OpenAPI document."""

from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify

from app.http.context import context
from app.http.guards import PUBLIC_ENDPOINTS
from app.http.replies import KHALA_BLUEPRINTS
from app.http.openapi import build_spec, documented
from app.http.submissions import music_limits

blueprint = Blueprint("pages", __name__)


@blueprint.get("/")
@documented("The operator/user page", responses={200: ("the page", None)}, media=("text/html",))
def index() -> Response:
    """The operator/user page (static; it talks to the JSON API like any other client)."""
    return current_app.send_static_file("index.html")


@blueprint.get("/api/v1/openapi.json")
@documented("This API's OpenAPI 3.1 document", responses={200: ("the document", {"type": "object"})})
def openapi() -> Response:
    """This API's OpenAPI 3.1 document, generated from the routes and the request and reply models (built on
    the first request, once the application has all its routes, and kept on the application)."""
    if "OPENAPI" not in current_app.config:
        shared = context()
        current_app.config["OPENAPI"] = build_spec(
            current_app, music_limits(shared.settings, shared.profile), _is_protected, operation_id
        )
    return jsonify(current_app.config["OPENAPI"])


def _is_protected(endpoint: str) -> bool:
    return context().settings.authenticated and endpoint not in PUBLIC_ENDPOINTS


def operation_id(endpoint: str) -> str:
    """The native API's blueprints only group its views by concern, so their operation ids are the views'
    own names (`submit_music`, `get_job`: what generated clients name their methods). The Khala contract is
    mounted twice, so its ids carry the mount (`khala_generate`, `khala_api_generate`)."""
    mount, _, view = endpoint.rpartition(".")
    return endpoint.replace(".", "_") if mount in KHALA_BLUEPRINTS else view
