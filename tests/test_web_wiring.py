"""The web application is wired, not written, in `create_app` (issue 21, item 3): views are module-level
functions of the app/http blueprints that read the shared handles from the application they serve
(`current_app.extensions`), so two applications in one process keep their own settings, Redis and caches."""

from __future__ import annotations

import json
import re
import types

from app.http import errors
from app.http.context import WebContext, context
from app.web import create_app


def test_create_app_only_wires_views_defined_in_the_http_layer(make_stack):
    stack = make_stack()
    nested = [c.co_name for c in create_app.__code__.co_consts if isinstance(c, types.CodeType)]
    assert nested == [], f"create_app defines functions of its own: {nested}"
    views = {
        rule.endpoint: stack.app.view_functions[rule.endpoint]
        for rule in stack.app.url_map.iter_rules()
        if rule.endpoint != "static"
    }  # Flask's own
    # Every route is one the OpenAPI document describes, and every described one is routed (a set, not a count:
    # a new route needs no edit here, only its documentation).
    assert routed_operations(stack.app) == documented_operations(stack.client.get("/api/v1/openapi.json").get_json())
    for endpoint, view in views.items():
        assert view.__module__.startswith("app.http."), (endpoint, view.__module__)
        assert view.__closure__ is None and view.__qualname__ == view.__name__, f"{endpoint} is not module-level"
    handlers = [handler for by_code in stack.app.error_handler_spec[None].values() for handler in by_code.values()]
    assert sorted(h.__name__ for h in handlers) == sorted(h.__name__ for _, h in errors.HANDLERS)
    assert all(h.__module__ == "app.http.errors" for h in handlers)
    assert isinstance(stack.app.extensions["encore"], WebContext)


def routed_operations(app) -> set[tuple[str, str]]:
    """(method, path) of every route but Flask's static one, the path spelled as OpenAPI spells it."""
    operations = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule)
        operations |= {(method, path) for method in rule.methods - {"HEAD", "OPTIONS"}}
    return operations


def documented_operations(document: dict) -> set[tuple[str, str]]:
    methods = {"get", "post", "put", "patch", "delete"}
    return {(method.upper(), path) for path, item in document["paths"].items() for method in item if method in methods}


def test_two_apps_in_one_process_keep_their_own_settings_stores_and_caches(make_stack, tmp_path):
    catalogue_a, catalogue_b = ({"genre": {"label": name, "tags": [name]}} for name in ("app A", "app B"))
    (tmp_path / "a.json").write_text(json.dumps(catalogue_a))
    (tmp_path / "b.json").write_text(json.dumps(catalogue_b))
    a = make_stack(API_TOKEN="token-a", ENCORE_TAGS_FILE=str(tmp_path / "a.json"))
    b = make_stack(ENCORE_COMPAT_PREFIX="/khala", ENCORE_TAGS_FILE=str(tmp_path / "b.json"))
    assert a.app.extensions["encore"] is not b.app.extensions["encore"]
    with a.app.app_context():
        assert context().settings.api_tokens == ("token-a",) and context().settings.redis_url == a.redis_url
    with b.app.app_context():
        assert context().settings.api_tokens == () and context().settings.redis_url == b.redis_url

    # Requests alternate between the two: each app answers with its own settings, whichever was made last.
    assert a.client.get("/tags", headers=a.auth).get_json() == catalogue_a
    assert b.client.get("/khala/tags").get_json() == catalogue_b
    assert b.client.get("/tags").status_code == 404
    assert a.client.get("/api/tags", headers=a.auth).get_json() == catalogue_a
    assert a.client.get("/api/v1/jobs").status_code == 401  # A needs its token, which it accepts
    assert a.client.get("/api/v1/jobs", headers=a.auth).status_code == 200
    assert b.client.get("/api/v1/jobs").status_code == 200  # B has none
    assert b.client.get("/api/v1/jobs", headers={"Authorization": "Bearer token-a"}).status_code == 200

    job_a, job_b = a.submit_music(), b.submit_music()  # each in its own Redis database
    assert [j["job_id"] for j in a.client.get("/api/v1/jobs", headers=a.auth).get_json()["jobs"]] == [job_a]
    assert [j["job_id"] for j in b.client.get("/api/v1/jobs").get_json()["jobs"]] == [job_b]
    assert a.client.get(f"/api/v1/jobs/{job_b}", headers=a.auth).status_code == 404
    assert b.client.get(f"/api/v1/jobs/{job_a}").status_code == 404
    assert b.client.get(f"/khala/job/{job_b}").get_json()["job_id"] == job_b

    # The OpenAPI document is built on first use and kept per application: B's first, then A's.
    doc_b = b.client.get("/api/v1/openapi.json").get_json()
    doc_a = a.client.get("/api/v1/openapi.json", headers=a.auth).get_json()
    assert doc_a["paths"]["/api/v1/jobs"]["get"]["security"] == [{"bearer": []}]
    assert doc_b["paths"]["/api/v1/jobs"]["get"]["security"] == []
    assert "/tags" in doc_a["paths"] and "/khala/tags" not in doc_a["paths"]
    assert "/khala/tags" in doc_b["paths"] and "/tags" not in doc_b["paths"]
    assert b.client.get("/api/v1/openapi.json").get_json() == doc_b
