"""Job ids: random, unguessable, and checked before they reach a Redis key or a file path."""

from __future__ import annotations

import re
import secrets
from typing import NamedTuple

JOB_ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")


def new_job_id() -> str:
    return secrets.token_hex(16)


def is_job_id(value: str) -> bool:
    """True for ids `new_job_id` could have made: anything else is refused before it names a key or a folder."""
    return bool(JOB_ID_PATTERN.match(value))


class TrackRef(NamedTuple):
    """One track of one job: what a stage run holds a lease on, whichever job it belongs to (a run may serve
    tracks of several jobs)."""

    job_id: str
    track: int
