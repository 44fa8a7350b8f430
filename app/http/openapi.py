"""OpenAPI document for GET /api/v1/openapi.json, built by apispec from the app's own URL map, the `documented`
description on every view, and the pydantic models that validate requests and shape replies, so the document
cannot drift from the routes, the validation or the replies.

Answers every operation can give are added here rather than listed on each view: 401 where a token is
required (only when the server has one), 400/408/413 where a body is read, 404 where the path names something,
503 where Redis is read. tests/test_openapi.py runs schemathesis against a live server with this document.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from apispec import APISpec
from flask import Flask
from pydantic import BaseModel

from app.http import schemas
from app.http.uploads import LipsyncForm

JSON = "application/json"
# A redirect's body is the short HTML page Werkzeug's `redirect` writes (flask.redirect: 302, 307).
REDIRECTS = {301, 302, 303, 307, 308}
REDIRECT_MEDIA = "text/html"
REF_TEMPLATE = "#/components/schemas/{model}"
IGNORED_METHODS = {"HEAD", "OPTIONS"}
NO_REDIS = {"index", "openapi", "tags"}  # endpoints that answer without Redis (the tag catalogue is in memory)
Reply = tuple[str, "type[BaseModel] | dict[str, Any] | None"]
# What a file download (send_file, conditional, Range honoured) can answer besides its own 404s.
DOWNLOAD_REPLIES: dict[int, Reply | str] = {
    200: ("the file", None),
    206: ("the requested range", None),
    302: ("a presigned URL of the object store (ENCORE_S3_PRESIGN=1)", None),
    304: ("not modified since the client's copy", None),
    416: "range not satisfiable",
}
TOO_MANY = (
    "too many: the open tracks are at a cap (the job was not created), or the token's submit rate "
    "limit is spent; Retry-After says when to try again"
)
# Headers of a 429: Retry-After always; the rate limiter's window with a rate-limit refusal.
TOO_MANY_HEADERS = {
    "Retry-After": {
        "required": True,
        "description": "whole seconds to wait (from the ETA, or the limit's window)",
        "schema": {"type": "string", "pattern": "^[1-9][0-9]*$"},
    },
    **{
        name: {"required": False, "description": what, "schema": {"type": "string", "pattern": "^[0-9]+$"}}
        for name, what in (
            ("X-RateLimit-Limit", "requests the window allows"),
            ("X-RateLimit-Remaining", "requests left in the window"),
            ("X-RateLimit-Reset", "when the window resets (Unix seconds)"),
        )
    },
}


def forbidden_to_tenant(media: str, length_field: str) -> str:
    """The 403 of a submission its tenant may never make (app/control/tenant_limits.check_request)."""
    return (
        f"beyond what the token's tenant may ever ask for: a priority above its highest (`field`: priority), "
        f"or a {media} longer than its limit (`field`: {length_field})"
    )


def documented(
    summary: str,
    *,
    responses: dict[int, Reply | str],
    json_body: type[BaseModel] | None = None,
    form: type[BaseModel] | None = None,
    files: tuple[str, ...] = (),
    query: dict[str, dict[str, Any]] | None = None,
    headers: dict[str, dict[str, Any]] | None = None,
    media: tuple[str, ...] = (JSON,),
) -> Callable:
    """Attach an operation description to a view; build_spec reads it. `responses` maps a status to
    (description, reply model or raw schema) for 2xx/3xx and to a description for errors (ErrorReply bodies);
    `query` and `headers` name optional parameters and their schemas; `media` lists the content types of the
    success replies."""

    def attach(view: Callable) -> Callable:
        doc = {
            "summary": summary,
            "json_body": json_body,
            "form": form,
            "files": files,
            "query": query or {},
            "headers": headers or {},
            "responses": responses,
            "media": media,
        }
        setattr(view, "openapi", doc)  # noqa: B010 - a function's attribute, which its type does not declare
        return view

    return attach


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(model=model.__name__)}


def _form_schema(form: type[BaseModel] | None, files: tuple[str, ...], takes_webhooks: bool) -> dict[str, Any]:
    """One multipart object: the files and the optional form fields (numbers sent as text), nothing else; its
    webhook fields as this server takes them (schemas.webhook_form_fields)."""
    properties: dict[str, Any] = {name: {"type": "string", "format": "binary"} for name in files}
    webhook_fields, webhook_rule = schemas.webhook_form_fields(takes_webhooks)
    if form is not None:
        for name, field in form.model_json_schema()["properties"].items():
            typed = [s for s in field.get("anyOf", [field]) if s.get("type") != "null"]  # a form field is text
            described = {"description": field.get("description", "")}
            one = typed[0] if len(typed) == 1 else {"anyOf": typed}  # fps: 0, or from 1 to 120
            properties[name] = {**one, **described, **webhook_fields.get(name, {})}
    rule = webhook_rule if "webhook_events" in properties else {}
    return {
        "type": "object",
        "properties": properties,
        "required": list(files),
        "additionalProperties": False,
        **rule,
    }


def _request_body(doc: dict[str, Any], takes_webhooks: bool) -> dict[str, Any] | None:
    if doc["json_body"] is not None:
        return {"required": True, "content": {JSON: {"schema": _ref(doc["json_body"])}}}
    if doc["form"] is not None or doc["files"]:
        schema = _form_schema(doc["form"], doc["files"], takes_webhooks)
        return {"required": True, "content": {"multipart/form-data": {"schema": schema}}}
    return None


def _success(
    status: int, description: str, model: type[BaseModel] | dict[str, Any] | None, media: tuple[str, ...]
) -> dict[str, Any]:
    """A 2xx in the operation's media types; a redirect in Werkzeug's (its short HTML page, whatever the
    operation serves once followed); a 304 with no body."""
    if status == 304:
        return {"description": description}
    if status in REDIRECTS:
        return {"description": description, "content": {REDIRECT_MEDIA: {}}}
    schema = _ref(model) if isinstance(model, type) else model
    return {"description": description, "content": {m: ({"schema": schema} if schema else {}) for m in media}}


def _error(description: str, status: int = 0) -> dict[str, Any]:
    reply = {"description": description, "content": {JSON: {"schema": _ref(schemas.ErrorReply)}}}
    return {**reply, "headers": TOO_MANY_HEADERS} if status == 429 else reply


def _path_parameter(name: str, converter: str) -> dict[str, Any]:
    schema = {"type": "integer"} if converter == "IntegerConverter" else {"type": "string"}
    return {"name": name, "in": "path", "required": True, "schema": schema}


def _operation(
    endpoint: str, view: Callable, arguments: dict[str, str], protected: bool, operation_id: str, takes_webhooks: bool
) -> dict[str, Any]:
    doc = getattr(view, "openapi", None)
    if doc is None:
        raise ValueError(f"view {endpoint} has no @documented description")
    responses: dict[str, Any] = {}
    for status, reply in sorted(doc["responses"].items()):
        if status < 400:
            assert not isinstance(reply, str), f"{endpoint}: a {status} reply needs (description, model)"
            description, model = reply
            responses[str(status)] = _success(status, description, model, doc["media"])
        else:
            responses[str(status)] = _error(reply if isinstance(reply, str) else reply[0], status)
    body = _request_body(doc, takes_webhooks)
    implied = {401: "a valid bearer token is required"} if protected else {}
    if body:
        implied.update({400: "invalid field or body", 408: "the body stopped arriving", 413: "the body is too large"})
    if arguments:
        implied[404] = "nothing at this path"
    if endpoint.rsplit(".", 1)[-1] not in NO_REDIS:
        implied[503] = "the job store (Redis) is unavailable"
    for status, description in implied.items():
        responses.setdefault(str(status), _error(description))
    operation: dict[str, Any] = {
        "summary": doc["summary"],
        "operationId": operation_id,
        "responses": dict(sorted(responses.items())),
        "security": [{"bearer": []}] if protected else [],
    }
    parameters = [_path_parameter(name, converter) for name, converter in sorted(arguments.items())]
    parameters += [
        {"name": name, "in": "query", "required": False, "schema": schema} for name, schema in doc["query"].items()
    ]
    parameters += [
        {"name": name, "in": "header", "required": False, "schema": schema} for name, schema in doc["headers"].items()
    ]
    if parameters:
        operation["parameters"] = parameters
    if body:
        operation["requestBody"] = body
    return operation


def openapi_path(rule: str) -> str:
    """Flask's /jobs/<job_id> or /x/<int:n> → OpenAPI's /jobs/{job_id}, /x/{n}."""
    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule)


def _models(doc: dict[str, Any]) -> list[type[BaseModel]]:
    """The models an operation's description names: its JSON body's and its replies' (a form is written inline)."""
    replies = [reply[1] for reply in doc["responses"].values() if isinstance(reply, tuple)]
    return [m for m in (doc["json_body"], *replies) if isinstance(m, type) and issubclass(m, BaseModel)]


def _with_nested(name: str, schema: dict[str, Any], components: dict[str, dict[str, Any]]) -> None:
    """`schema` as component `name`, and the models it nests (pydantic's `$defs`, which its `$ref`s name as
    components) as components of their own."""
    schema = dict(schema)
    for nested_name, nested in schema.pop("$defs", {}).items():
        _with_nested(nested_name, nested, components)
    components[name] = schema


def build_spec(
    app: Flask,
    music_limits: dict[str, Any],
    is_protected: Callable[[str], bool],
    operation_id: Callable[[str], str],
    title: str = "Encore",
    version: str = "1",
) -> dict[str, Any]:
    """The document for `app` as configured: its duration and size limits, whether it takes webhooks
    (`music_limits["webhooks"]`: it has a secret to sign them), security where a token is
    required (`is_protected(endpoint)`; with no API_TOKEN nothing is), and each operation's id
    (`operation_id(endpoint)`)."""
    spec = APISpec(
        title=title,
        version=version,
        openapi_version="3.1.0",
        info={"description": "GPU job service: music generation and lip-sync on Celery + Redis."},
        components={"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    )
    # Every model an operation names, every model those nest, the lip-sync form's fields and the error body:
    # each `$ref` of the document names one of these components.
    models: dict[str, type[BaseModel]] = {m.__name__: m for m in (LipsyncForm, schemas.ErrorReply)}
    paths: dict[str, dict[str, Any]] = {}
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        view = app.view_functions[rule.endpoint]
        arguments = {name: type(rule._converters[name]).__name__ for name in rule.arguments}
        operations = paths.setdefault(openapi_path(rule.rule), {})
        for method in sorted((rule.methods or set()) - IGNORED_METHODS):
            operations[method.lower()] = _operation(
                rule.endpoint,
                view,
                arguments,
                is_protected(rule.endpoint),
                operation_id(rule.endpoint),
                bool(music_limits.get("webhooks")),
            )
            models.update((model.__name__, model) for model in _models(view.openapi))  # type: ignore[union-attr]
    components: dict[str, dict[str, Any]] = {}
    for name, model in sorted(models.items()):
        schema = (
            schemas.music_request_schema(music_limits)
            if model is schemas.MusicRequest
            else model.model_json_schema(ref_template=REF_TEMPLATE)
        )
        _with_nested(name, schema, components)
    for name, schema in sorted(components.items()):
        spec.components.schema(name, schema)
    for path, operations in sorted(paths.items()):
        spec.path(path=path, operations=operations)
    return spec.to_dict()
