"""Idempotent submits: a client that retries a submission with the same `Idempotency-Key` gets the job its
first request created instead of a second one, per API token ("anonymous" without one), for as long as jobs
live (ENCORE_JOB_TTL_S); the same key with another body is a client bug, answered 409.

One `SET NX` claims the key for (body hash, job id) before the job is written, with a job id drawn first, so
two concurrent retries can never both create a job: the loser reads the winner's id and waits for its record.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from app.adapters.redis_conn import decoded
from app.core.ids import new_job_id
from app.control.scripts import script
from app.control.services import Services

HEADER = "Idempotency-Key"
KEY = re.compile(r"[\x21-\x7e]{1,255}", re.ASCII)  # printable ASCII without spaces, as the IETF draft's examples
PATTERN = r"^[\x21-\x7e]{1,255}$"  # the same, for the OpenAPI document
OPENAPI_HEADER = {
    HEADER: {  # the header as the submit routes document it (app/http/openapi.py)
        "type": "string",
        "pattern": PATTERN,
        "description": "a retry with the same key (per token) within the job "
        "TTL gets the same job (200) instead of a second one; the same key with another body: 409",
    }
}
WAIT_FOR_FIRST_S = 10.0  # how long a retry waits for a concurrent first request to write its job


class IdempotencyError(Exception):
    """A key that cannot be honoured: malformed (400), or already used with another body / still running (409)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{HEADER}: {message}")
        self.status = status
        self.field = HEADER


@dataclass(frozen=True)
class Claim:
    key: str  # the Redis key
    value: str  # "body hash|job id"
    job_id: str
    fresh: bool  # this request claimed it and must create `job_id` (or release the claim)


def checked_key(value: str) -> str:
    if not KEY.fullmatch(value):
        raise IdempotencyError(400, "1 to 255 printable ASCII characters, no spaces")
    return value


def json_digest(body: dict[str, Any]) -> str:
    """The body's hash, independent of key order and whitespace."""
    import json

    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def form_digest(fields: dict[str, str], files: Iterable[tuple[str, Path]]) -> str:
    """A multipart body's hash: its text fields and the bytes of its files."""
    digest = hashlib.sha256()
    for name, value in sorted(fields.items()):
        digest.update(f"field {name}={value}\n".encode())
    for name, path in sorted(files):
        with open(path, "rb") as handle:
            digest.update(f"file {name}={hashlib.file_digest(handle, 'sha256').hexdigest()}\n".encode())
    return digest.hexdigest()


def claim(svc: Services, owner: str, key: str, body_hash: str) -> Claim:
    """Claim `key` for this body and a new job id, or find the earlier claim; 409 when its body differs."""
    redis_key = svc.jobs.keys.idempotency(owner, hashlib.sha256(key.encode()).hexdigest())
    while True:
        job_id = new_job_id()
        value = f"{body_hash}|{job_id}"
        if svc.redis.set(redis_key, value, nx=True, ex=svc.settings.job_ttl_s):
            return Claim(redis_key, value, job_id, True)
        held = decoded(svc.redis.get(redis_key))
        if held is None:
            continue  # it expired (or its first request failed) in between: claim it again
        held_hash, _, held_job = held.partition("|")
        if held_hash != body_hash:
            raise IdempotencyError(409, "already used with a different request body")
        return Claim(redis_key, held, held_job, False)


def release(svc: Services, held: Claim) -> None:
    """The first request failed before its job existed: the key is free again (only if still its claim)."""
    script(svc.redis, "release_lock")(keys=[held.key], args=[held.value])


def submit_once(svc: Services, owner: str, key: str, body_hash: str, create: Callable[[str], str]) -> tuple[str, bool]:
    """`create(job_id)` at most once per key: (job id, whether it is an earlier request's job)."""
    held = claim(svc, owner, key, body_hash)
    if not held.fresh:
        if not _wait_for_record(svc, held.job_id):
            raise IdempotencyError(409, "a request with this key is still being processed; retry later")
        return held.job_id, True
    try:
        create(held.job_id)
    except BaseException:
        release(svc, held)
        raise
    return held.job_id, False


def _wait_for_record(svc: Services, job_id: str) -> bool:
    """A concurrent first request claimed the key and is writing its job: poll for it, with a deadline."""
    deadline = time.monotonic() + WAIT_FOR_FIRST_S
    while svc.jobs.job(job_id) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
