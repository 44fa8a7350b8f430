"""The OpenAPI document and the server agree on the inputs a tester found them disagreeing on: what the document
forbids the server refuses (400 naming the field), and what the server accepts the document allows. Each case is
checked both ways: the served document's own schema (jsonschema_rs, 2020-12) and a real request."""

from __future__ import annotations

import random
import re
from typing import Any

import jsonschema_rs
import pytest

from app.http.events import valid_event_id
from harness.media import face_video, tone, upload
from harness.stack import Stack

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


@pytest.mark.parametrize("prompt_mode", ["tags", "natural"])
@pytest.mark.parametrize(
    "field, value",
    [
        ("tags", [["pop", "piano"]]),
        ("tags", ["pop"]),
        ("tags", {"pop": 1}),
        ("tags", 3),
        ("prompt", [["calm"]]),
        ("lyrics", [["la la"]]),
        ("tags", "pop\x1b"),
    ],
)
def test_a_khala_text_that_is_not_text_is_refused_by_both_whatever_the_prompt_mode(
    stack, document, prompt_mode, field, value
):
    """The reference types prompt, tags and lyrics as strings: a nested array of tags was accepted (prompt_mode
    natural reads only the prompt), though the document refuses it."""
    body = {**SONG, "prompt_mode": prompt_mode, "prompt": "a calm song", field: value}
    assert _allows(document, _component("KhalaGenerate"), {**body, field: SONG.get(field, "a calm song")})
    assert not _allows(document, _component("KhalaGenerate"), body)
    reply = stack.client.post("/generate", json=body)
    assert reply.status_code == 400 and reply.get_json()["field"] == field, reply.get_json()
    assert stack.client.get("/api/v1/jobs").get_json()["jobs"] == []


def test_khala_text_fields_may_be_null_when_unused(stack, document):
    body = {**SONG, "prompt_mode": "natural", "prompt": "a calm song", "tags": None}
    assert _allows(document, _component("KhalaGenerate"), body)
    assert stack.client.post("/generate", json=body).status_code == 200


@pytest.mark.parametrize(
    "field, value, ok",
    [
        ("seed", 315.0, True),
        ("top_k", 5.0, True),
        ("num_tracks", 1.0, True),
        ("seed", 315.5, False),
        ("top_k", "5", False),
        ("num_tracks", True, False),
    ],
)
def test_a_native_whole_number_written_with_a_fraction_is_taken_by_both(stack, document, field, value, ok):
    """JSON Schema's integer takes 315.0, and so must the server (it refused `seed` 315.0 as no integer)."""
    body = {"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, field: value}
    assert _allows(document, _component("MusicRequest"), body) is ok
    reply = stack.client.post("/api/v1/music", json=body, headers=stack.auth)
    if ok:
        assert reply.status_code == 202, reply.get_json()
        assert stack.job(reply.get_json()["job_id"])["params"][field] == int(value)
    else:
        assert reply.status_code == 400 and reply.get_json()["field"] == field, reply.get_json()


def _lipsync_form(document: dict[str, Any]) -> dict[str, Any]:
    return {
        **document,
        **document["paths"]["/api/v1/lipsync"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"],
    }


def _form_allows(document: dict[str, Any], fields: dict[str, str | float]) -> bool:
    form = {"video": "...", "audio": "...", **fields}
    return jsonschema_rs.Draft202012Validator(_lipsync_form(document)).is_valid(form)


@pytest.mark.parametrize("fps, ok", [(0.5, False), (2.8e-05, False), (0, True), (1, True), (29.97, True)])
def test_a_lipsync_frame_rate_between_0_and_1_is_refused_by_the_form_schema_too(document, fps, ok):
    """The form schema dropped the field's `not` (no rate between 0 and 1), which the server refuses naming `fps`
    (tests/test_lipsync_api.py); schemathesis sent 2.8e-05."""
    assert _form_allows(document, {"fps": fps}) is ok


def test_without_a_webhook_secret_both_take_no_webhook(stack, document):
    """The server refuses every webhook when it has no ENCORE_WEBHOOK_SECRET to sign them: the document says so
    (null only in JSON, empty in the form) rather than allow any string."""
    body = {"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "webhook": "https://example.com/hook"}
    assert not _allows(document, _component("MusicRequest"), body)
    assert _allows(document, _component("MusicRequest"), {**body, "webhook": None})
    reply = stack.client.post("/api/v1/music", json=body, headers=stack.auth)
    assert reply.status_code == 400 and reply.get_json()["field"] == "webhook", reply.get_json()
    assert not _form_allows(document, {"webhook": "https://example.com/hook"})
    assert _form_allows(document, {"webhook": "", "webhook_events": ""})


@pytest.fixture
def signing(make_stack) -> Stack:
    return make_stack(ENCORE_WEBHOOK_SECRET="whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")


@pytest.mark.parametrize(
    "url, ok",
    [
        ("https://example.com/hook", True),
        ("http://hooks.example.org:443/a?b=c#d", True),
        ("HTTPS://Example.COM./x", True),
        ("ftp://example.com/", False),
        ("http://localhost/", False),
        ("http://a.localhost:80/", False),
        ("http://example.com:8080/", False),
        ("http://user@example.com/", False),
        ("http://exa mple.com/", False),
        ("http://127.0.0.1/", False),
        ("", False),
    ],
)
def test_a_webhook_url_is_judged_alike_by_both(signing, url, ok):
    document = signing.client.get("/api/v1/openapi.json").get_json()
    body = {"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "webhook": url}
    assert _allows(document, _component("MusicRequest"), body) is ok
    reply = signing.client.post("/api/v1/music", json=body, headers=signing.auth)
    if ok:
        assert reply.status_code == 202, reply.get_json()
    else:
        assert reply.status_code == 400 and reply.get_json()["field"] == "webhook", reply.get_json()


def test_webhook_events_without_a_url_are_refused_by_both(signing, clips_dir):
    """In JSON (the document now says the dependency) and in the form, where `webhook_events` holding only commas
    or spaces was taken without a URL though the form schema refuses it."""
    document = signing.client.get("/api/v1/openapi.json").get_json()
    body = {"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "webhook_events": ["completed"]}
    assert not _allows(document, _component("MusicRequest"), body)
    assert _allows(document, _component("MusicRequest"), {**body, "webhook": "https://example.com/hook"})
    reply = signing.client.post("/api/v1/music", json=body, headers=signing.auth)
    assert reply.status_code == 400 and reply.get_json()["field"] == "webhook_events", reply.get_json()
    for events in ("completed", " , "):
        assert not _form_allows(document, {"webhook_events": events})
        assert _form_allows(document, {"webhook": "https://example.com/hook", "webhook_events": "start, completed"})
        reply = upload(signing.client, *clips_dir, webhook_events=events)
        assert reply.status_code == 400 and reply.get_json()["field"] == "webhook_events", reply.get_json()


@pytest.fixture(scope="module")
def clips_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    return face_video(root / "face.mp4", 3.2), tone(root / "voice.wav", 2.0)


def test_the_documented_last_event_id_is_exactly_what_the_server_takes(stack, document):
    """The document's pattern for Last-Event-ID and the server's check are one expression: each part a number of at
    most 2**64 - 1 (a 20-digit part above it matched the old [0-9]{1,20} pattern and was refused 400)."""
    [header] = [
        parameter
        for parameter in document["paths"]["/api/v1/jobs/{job_id}/events"]["get"]["parameters"]
        if parameter["name"] == "Last-Event-ID"
    ]
    pattern = re.compile(header["schema"]["pattern"])
    top = 2**64 - 1
    rng = random.Random(36)
    parts = [0, 1, 9, top, top - 1, top + 1, 10**19, 10**19 - 1, 10**20 - 1, 2**65]
    parts += [rng.randrange(0, 10**20) for _ in range(300)]
    for part in parts:
        for text in (str(part), str(part).zfill(20)):
            event_id = f"{text}-0"
            fits = len(text) <= 20 and part <= top
            assert bool(pattern.fullmatch(event_id)) == fits == valid_event_id(event_id), event_id
    assert pattern.fullmatch("") and not pattern.fullmatch("1-") and not pattern.fullmatch("-1")
    job_id = stack.submit_music(duration_s=2.0)
    for event_id, status in ((f"{top}-{top}", 200), (f"{top + 1}-0", 400), (f"0-{top + 1}", 400)):
        reply = stack.client.get(f"/api/v1/jobs/{job_id}/events", headers={"Last-Event-ID": event_id}, buffered=False)
        assert reply.status_code == status, (event_id, reply.status_code)
        reply.close()
