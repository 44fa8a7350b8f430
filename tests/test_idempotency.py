"""Idempotency-Key on the submit routes (issue 14, item 3), over real HTTP against a real Redis: a retry with the
same key and body gets the same job (200, the same body), never a second one, even when the retries race; the
same key with another body is 409 naming the header; keys are per token; the Khala-compatible submit too."""

from __future__ import annotations

import threading

import requests

from harness import media

MUSIC = {"mode": "instrumental", "tags": "lo-fi", "duration_s": 2.0, "num_tracks": 1, "seed": 4}


def job_count(stack) -> int:
    return stack.redis.zcard("encore:jobs")


def test_same_key_same_job_other_body_409(make_stack):
    stack = make_stack()  # no worker: jobs just wait
    url = f"{stack.base_url}/api/v1/music"
    first = requests.post(url, json=MUSIC, headers={"Idempotency-Key": "order-1"}, timeout=10)
    assert first.status_code == 202, first.text
    again = requests.post(
        url, json=dict(reversed(list(MUSIC.items()))), headers={"Idempotency-Key": "order-1"}, timeout=10
    )  # the same body, its keys in another order
    assert again.status_code == 200 and again.json() == first.json()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert job_count(stack) == 1

    other = requests.post(url, json={**MUSIC, "seed": 5}, headers={"Idempotency-Key": "order-1"}, timeout=10)
    assert other.status_code == 409 and other.json()["field"] == "Idempotency-Key"
    assert "Idempotency-Key" in other.json()["error"] and job_count(stack) == 1

    second = requests.post(url, json=MUSIC, headers={"Idempotency-Key": "order-2"}, timeout=10)
    assert second.status_code == 202 and second.json()["job_id"] != first.json()["job_id"]
    plain = [requests.post(url, json=MUSIC, timeout=10) for _ in range(2)]  # no key: every request is a job
    assert [r.status_code for r in plain] == [202, 202] and job_count(stack) == 4

    malformed = requests.post(url, json=MUSIC, headers={"Idempotency-Key": "two words"}, timeout=10)
    assert malformed.status_code == 400 and malformed.json()["field"] == "Idempotency-Key"
    invalid = requests.post(url, json={**MUSIC, "seed": -1}, headers={"Idempotency-Key": "order-3"}, timeout=10)
    assert invalid.status_code == 400 and invalid.json()["field"] == "seed"  # an invalid body claims no key
    fixed = requests.post(url, json=MUSIC, headers={"Idempotency-Key": "order-3"}, timeout=10)
    assert fixed.status_code == 202 and job_count(stack) == 5
    # The claim expires with the jobs.
    [key] = [k for k in stack.redis.scan_iter("encore:idempotency:tenant-default:*")][:1]
    assert 0 < stack.redis.ttl(key) <= stack.settings.job_ttl_s


def test_racing_retries_make_one_job(make_stack):
    stack = make_stack()
    url = f"{stack.base_url}/api/v1/music"
    replies: list[requests.Response] = []
    barrier = threading.Barrier(8)

    def send() -> None:
        barrier.wait()
        replies.append(requests.post(url, json=MUSIC, headers={"Idempotency-Key": "race"}, timeout=30))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(r.status_code for r in replies) == [200] * 7 + [202]
    assert len({r.json()["job_id"] for r in replies}) == 1 and job_count(stack) == 1


def test_keys_are_per_token_and_the_khala_submit_honours_them(make_stack):
    stack = make_stack(API_TOKEN="alice,bob")
    url = f"{stack.base_url}/api/v1/music"
    alice = {"Authorization": "Bearer alice", "Idempotency-Key": "k"}
    bob = {"Authorization": "Bearer bob", "Idempotency-Key": "k"}
    a1 = requests.post(url, json=MUSIC, headers=alice, timeout=10)
    b1 = requests.post(url, json={**MUSIC, "seed": 9}, headers=bob, timeout=10)  # bob's "k" is not alice's
    assert (a1.status_code, b1.status_code) == (202, 202) and a1.json()["job_id"] != b1.json()["job_id"]
    assert requests.post(url, json=MUSIC, headers=alice, timeout=10).json()["job_id"] == a1.json()["job_id"]

    khala = {"mode": "instrumental", "prompt_mode": "tags", "tags": "lo-fi", "duration": 1}
    headers = {"Authorization": "Bearer alice", "Idempotency-Key": "khala-1"}
    k1 = requests.post(f"{stack.base_url}/generate", json=khala, headers=headers, timeout=10)
    k2 = requests.post(f"{stack.base_url}/api/generate", json=khala, headers=headers, timeout=10)
    assert k1.status_code == k2.status_code == 200 and k1.json()["job_id"] == k2.json()["job_id"]
    conflict = requests.post(f"{stack.base_url}/generate", json={**khala, "tags": "jazz"}, headers=headers, timeout=10)
    assert conflict.status_code == 409 and conflict.json()["status"] == "error"
    assert job_count(stack) == 3


def test_lipsync_submit_is_idempotent_over_the_uploaded_files(make_stack, tmp_path):
    stack = make_stack()
    video = media.face_video(tmp_path / "face.mp4", seconds=3.2)
    audio = media.tone(tmp_path / "tone.wav", seconds=1.0)
    other_audio = media.tone(tmp_path / "other.wav", seconds=1.0, freq=440.0)

    def upload(audio_path, **fields):
        with open(video, "rb") as v, open(audio_path, "rb") as a:
            return requests.post(
                f"{stack.base_url}/api/v1/lipsync",
                files={"video": v, "audio": a},
                data={"fps": "10", **fields},
                headers={"Idempotency-Key": "clip-1"},
                timeout=60,
            )

    first = upload(audio)
    assert first.status_code == 202, first.text
    again = upload(audio)
    assert again.status_code == 200 and again.json()["job_id"] == first.json()["job_id"]
    assert upload(other_audio).status_code == 409  # same fields, other audio bytes
    assert upload(audio, fps="12").status_code == 409
    assert job_count(stack) == 1
