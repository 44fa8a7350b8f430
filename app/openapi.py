"""OpenAPI document for GET /api/v1/openapi.json, built by apispec from the app's own URL map and the
pydantic models that validate requests (their JSON Schemas are the request bodies), so the spec cannot
drift from the routes or the validation."""
from __future__ import annotations

import re
from typing import Any, Callable

from apispec import APISpec
from flask import Flask
from pydantic import BaseModel

from app.schemas import Accepted, ErrorReply, MusicRequest
from app.uploads import LipsyncForm

MODELS: tuple[type[BaseModel], ...] = (MusicRequest, LipsyncForm, Accepted, ErrorReply)
IGNORED_METHODS = {"HEAD", "OPTIONS"}


def documented(summary: str, *, json_body: type[BaseModel] | None = None, form: type[BaseModel] | None = None,
               files: tuple[str, ...] = (), responses: dict[int, tuple[str, type[BaseModel] | None]] | None = None,
               media: str = "application/json") -> Callable:
    """Attach an operation description to a view; build_spec reads it."""
    def attach(view: Callable) -> Callable:
        view.openapi = {"summary": summary, "json_body": json_body, "form": form, "files": files,
                        "responses": responses or {200: ("OK", None)}, "media": media}
        return view
    return attach


def _schema_ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _request_body(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["json_body"] is not None:
        return {"required": True, "content": {"application/json": {"schema": _schema_ref(doc["json_body"])}}}
    if doc["form"] is not None or doc["files"]:
        properties = {name: {"type": "string", "format": "binary"} for name in doc["files"]}
        schema: dict[str, Any] = {"type": "object", "properties": properties, "required": list(doc["files"])}
        if doc["form"] is not None:
            schema = {"allOf": [_schema_ref(doc["form"]), schema]}
        return {"required": True, "content": {"multipart/form-data": {"schema": schema}}}
    return None


def _operation(view: Callable, rule_args: set[str]) -> dict[str, Any]:
    doc = getattr(view, "openapi", None) or {"summary": (view.__doc__ or view.__name__).strip().splitlines()[0],
                                              "json_body": None, "form": None, "files": (),
                                              "responses": {200: ("OK", None)}, "media": "application/json"}
    responses = {}
    for status, (description, model) in doc["responses"].items():
        content = {doc["media"] if status < 300 else "application/json":
                   {"schema": _schema_ref(model)} if model else {}}
        responses[str(status)] = {"description": description, "content": content}
    operation: dict[str, Any] = {"summary": doc["summary"], "operationId": view.__name__, "responses": responses}
    if rule_args:
        operation["parameters"] = [{"name": a, "in": "path", "required": True, "schema": {"type": "string"}}
                                   for a in sorted(rule_args)]
    body = _request_body(doc)
    if body:
        operation["requestBody"] = body
    return operation


def openapi_path(rule: str) -> str:
    """Flask's /jobs/<job_id> or /x/<int:n> → OpenAPI's /jobs/{job_id}, /x/{n}."""
    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule)


def build_spec(app: Flask, title: str = "Encore", version: str = "1") -> dict[str, Any]:
    spec = APISpec(title=title, version=version, openapi_version="3.1.0",
                   info={"description": "GPU job service: music generation and lip-sync on Celery + Redis."},
                   components={"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}})
    for model in MODELS:
        spec.components.schema(model.__name__, model.model_json_schema(ref_template="#/components/schemas/{model}"))
    paths: dict[str, dict[str, Any]] = {}
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        view = app.view_functions[rule.endpoint]
        operations = paths.setdefault(openapi_path(rule.rule), {})
        for method in sorted(rule.methods - IGNORED_METHODS):
            operations[method.lower()] = _operation(view, set(rule.arguments))
    for path, operations in sorted(paths.items()):
        spec.path(path=path, operations=operations)
    return spec.to_dict()
