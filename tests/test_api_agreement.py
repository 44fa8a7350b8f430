"""The OpenAPI document and the server agree on the inputs a tester found them disagreeing on: what the document
forbids the server refuses (400 naming the field), and what the server accepts the document allows. Each case is
checked both ways: the served document's own schema (jsonschema_rs, 2020-12) and a real request."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
import pytest

from tests.support.stack import Stack

SONG = {"mode": "vocal", "prompt_mode": "tags", "tags": "pop, piano", "lyrics": "[verse]\nla la la", "duration": 1}


@pytest.fixture
def stack(make_stack) -> Stack:
    return make_stack()  # no worker: an accepted job just waits


@pytest.fixture
def document(stack) -> dict[str, Any]:
    return stack.client.get("/api/v1/openapi.json").get_json()


def _allows(document: dict[str, Any], schema: dict[str, Any], value: Any) -> bool:
    """Whether `schema` (which may $ref the document's components) takes `value`."""
    return jsonschema_rs.Draft202012Validator({**document, **schema}).is_valid(value)


def _component(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _parameter(document: dict[str, Any], path: str, where: str, name: str) -> dict[str, Any]:
    return next(
        p["schema"] for p in document["paths"][path]["get"]["parameters"] if p["in"] == where and p["name"] == name
    )


@pytest.mark.parametrize(
    "limit, ok", [("501", False), ("0", False), ("abc", False), ("1.5", False), ("500", True), ("1", True)]
)
def test_the_job_list_limit(stack, document, limit, ok):
    schema = _parameter(document, "/api/v1/jobs", "query", "limit")
    value: Any = int(limit) if limit.isdigit() else limit
    assert _allows(document, schema, value) is ok
    reply = stack.client.get(f"/api/v1/jobs?limit={limit}")
    if ok:
        assert reply.status_code == 200
    else:
        assert reply.status_code == 400 and reply.get_json()["field"] == "limit", reply.get_json()


def test_an_empty_last_event_id_is_allowed_by_both(stack, document):
    schema = _parameter(document, "/api/v1/jobs/{job_id}/events", "header", "Last-Event-ID")
    assert _allows(document, schema, "") and _allows(document, schema, "1-0")
    assert not _allows(document, schema, "x")
    job_id = stack.submit_music()
    assert stack.client.delete(f"/api/v1/jobs/{job_id}").status_code == 200  # canceled: its stream ends at once
    reply = stack.client.get(f"/api/v1/jobs/{job_id}/events", headers={"Last-Event-ID": ""})
    assert reply.status_code == 200 and "event: end" in reply.get_data(as_text=True)


@pytest.mark.parametrize("field", ["tags", "lyrics"])
def test_a_control_character_in_a_khala_text_is_refused_by_both(stack, document, field):
    body = {**SONG, field: SONG[field] + "\x01"}
    assert not _allows(document, _component("KhalaGenerate"), body)
    assert _allows(document, _component("KhalaGenerate"), SONG)
    reply = stack.client.post("/generate", json=body)
    assert reply.status_code == 400 and reply.get_json()["field"] == field, reply.get_json()


def test_a_control_character_in_a_khala_prompt_is_refused_by_both(stack, document):
    body = {**SONG, "prompt_mode": "natural", "prompt": "a calm\x07 song"}
    assert not _allows(document, _component("KhalaGenerate"), body)
    assert stack.client.post("/generate", json=body).status_code == 400


def test_a_control_character_in_a_native_text_is_refused_by_both(stack, document):
    body = {"tags": "rock\x1b", "lyrics": "la la", "duration_s": 5}
    assert not _allows(document, _component("MusicRequest"), body)
    assert _allows(document, _component("MusicRequest"), {**body, "tags": "rock"})
    reply = stack.client.post("/api/v1/music", json=body, headers=stack.auth)
    assert reply.status_code == 400 and reply.get_json()["field"] == "tags", reply.get_json()


@pytest.mark.parametrize(
    "value, ok", [(2.5, False), ("x", False), ("2.5", False), (True, False), (40, True), (40.0, True), (" 40 ", True)]
)
def test_khala_whole_numbers(stack, document, value, ok):
    body = {**SONG, "top_k_bb": value}
    assert _allows(document, _component("KhalaGenerate"), body) is ok
    reply = stack.client.post("/generate", json=body)
    assert (reply.status_code in (200, 202)) is ok, reply.get_json()
    if not ok:
        assert reply.get_json()["field"] == "top_k_bb"
