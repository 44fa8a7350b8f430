"""Hostile requests against the real app (issue 11): each is a 4xx naming the field, never a 5xx, and
nothing is queued. The app talks to a real redis-server; no worker runs here."""
from __future__ import annotations

import json

import pytest

MUSIC = {"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "num_tracks": 1}
KHALA = {"mode": "instrumental", "prompt_mode": "tags", "tags": "lo-fi", "duration": 1}


@pytest.fixture
def stack(make_stack):
    return make_stack(API_TOKEN="tok")


AUTH = {"Authorization": "Bearer tok"}


def _post_raw(stack, path: str, raw: str | bytes):
    return stack.client.post(path, data=raw, headers={**AUTH, "Content-Type": "application/json"})


def _nothing_queued(stack) -> None:
    assert stack.client.get("/api/v1/jobs", headers=AUTH).get_json()["jobs"] == []


@pytest.mark.parametrize("path", ["/api/v1/music", "/generate", "/api/generate"])
def test_deeply_nested_json_is_400_before_it_is_parsed(stack, path):
    reply = _post_raw(stack, path, "[" * 50_000 + "]" * 50_000)
    assert reply.status_code == 400 and "nested deeper than 32 levels" in reply.get_json()["error"]
    object_nest = '{"tags": ' + '{"a": ' * 40 + "1" + "}" * 40 + "}"
    assert _post_raw(stack, path, object_nest).status_code == 400
    brackets_in_a_string = json.dumps({**(MUSIC if path == "/api/v1/music" else KHALA), "tags": "[" * 500})
    assert _post_raw(stack, path, brackets_in_a_string).status_code in (202, 200)  # only real nesting counts


@pytest.mark.parametrize("path,body", [("/api/v1/music", MUSIC), ("/generate", KHALA)])
def test_a_number_too_large_for_a_float_is_400_naming_it(stack, path, body):
    raw = json.dumps(body)[:-1] + ', "temperature": 1' + "0" * 400 + "}"
    reply = _post_raw(stack, path, raw)
    assert reply.status_code == 400, reply.get_json()
    assert reply.get_json()["error"].startswith("temperature")
    huge = json.dumps(body)[:-1] + ', "temperature": 1' + "0" * 5000 + "}"  # past Python's int digit limit
    assert _post_raw(stack, path, huge).status_code == 400
    _nothing_queued(stack)


@pytest.mark.parametrize("header", ["Bearer é", "Bearer tok\u00e9", "Bearer \u00ff\u00fe", "Basic é"])
def test_a_non_ascii_authorization_header_is_401(stack, header):
    reply = stack.client.get("/api/v1/status", headers={"Authorization": header})
    assert reply.status_code == 401 and reply.get_json()["field"] == "authorization"
    assert stack.client.get("/api/v1/status", headers=AUTH).status_code == 200


@pytest.mark.parametrize("field", ["tags", "lyrics", "prompt"])
@pytest.mark.parametrize("bad", ["\\ud800", "a\\udfffb", "x\\u0000y", "\\u001b[31m"])
def test_text_the_tokenizer_cannot_take_is_400_naming_the_field(stack, field, bad):
    body = {"mode": "vocal", "tags": "pop", "lyrics": "[verse]\nla la", "duration_s": 2.0, "num_tracks": 1}
    raw = json.dumps(body)[:-1] + f', "{field}": "{bad}"' + "}" if field == "prompt" else \
        json.dumps(body).replace(json.dumps(body[field]), f'"{bad}"')
    reply = _post_raw(stack, "/api/v1/music", raw)
    assert reply.status_code == 400, reply.get_json()
    assert reply.get_json()["field"] == field and "U+" in reply.get_json()["error"]
    _nothing_queued(stack)


def test_lyrics_keep_their_line_breaks_and_tabs(stack):
    body = {"mode": "vocal", "tags": "pop", "lyrics": "[verse]\r\nla\tla\nla", "duration_s": 2.0, "num_tracks": 1}
    assert _post_raw(stack, "/api/v1/music", json.dumps(body)).status_code == 202


@pytest.mark.parametrize("method,path,allowed", [("TRACE", "/api/v1/music", "POST"), ("PUT", "/api/v1/jobs/" + "a" * 32,
                                                  "DELETE, GET"), ("DELETE", "/generate", "POST")])
def test_405_says_which_methods_are_allowed(stack, method, path, allowed):
    reply = stack.client.open(path, method=method, headers=AUTH)
    assert reply.status_code == 405 and reply.get_json()["error"]
    assert set(reply.headers["Allow"].split(", ")) >= set(allowed.split(", "))


@pytest.mark.parametrize("name", ["0.mp3%0a", "%D9%A0.mp3", "000.mp3", "01.wav", "0.mp3.", "0.MP3", "1000.mp3"])
def test_track_file_names_are_matched_exactly(stack, name):
    reply = stack.client.get(f"/api/v1/jobs/{'a' * 32}/tracks/{name}", headers=AUTH)
    assert reply.status_code == 404 and reply.get_json()["field"] == "file", (name, reply.get_json())
    known = stack.client.get(f"/api/v1/jobs/{'a' * 32}/tracks/0.mp3", headers=AUTH)
    assert known.status_code == 404 and "not found" in known.get_json()["error"]  # the name passed; no such job


def test_metrics_names_one_charset(stack):
    content_type = stack.client.get("/metrics").headers["Content-Type"]
    assert content_type.count("charset") == 1, content_type


def test_a_lipsync_jobs_track_download_says_where_its_result_is(stack):
    svc = stack.app.config["SERVICES"]
    job_id = svc.jobs.create("lipsync", {}, [{}], cost=1.0)
    ids = ["p", "l", "m"]
    assert svc.jobs.route(job_id, 0, "gpu0", ids)
    for task_id, stage in zip(ids, ("prepare", "lipsync", "mux")):  # the transitions a worker makes
        owner = f"gpu0@x|{task_id}|1"
        assert svc.jobs.transition("start", job_id, 0, stage=stage, owner=owner, task_id=task_id, worker="gpu0@x",
                                   lease_ms=60_000)
        assert svc.jobs.transition("finish", job_id, 0, {"artifacts": ["output.mp4"]}, stage=stage, owner=owner)
    reply = stack.client.get(f"/api/v1/jobs/{job_id}/tracks/0.mp3", headers=AUTH)
    assert reply.status_code == 404
    assert reply.get_json()["error"] == f"track 0 has no file track0.mp3 (a lip-sync job: its result is " \
                                        f"/api/v1/jobs/{job_id}/video.mp4)"
