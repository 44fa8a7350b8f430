"""The client's job record as the API documents it, written in plain Python from the internal record: the reference
the served record (rendered by the state machine's writes and the poll's read, app/control/lua/job_view.lua and
read_job.lua, the one source the web serves for polls, lists, cancels and retries) is tested against."""

from __future__ import annotations

import re
from typing import Any

from app.control.views import JOBS_URL, PRIVATE_TRACK_FIELDS

TRACK_FILE = re.compile(r"(0|[1-9][0-9]{0,2})\.(mp3|wav)", re.ASCII)


def public_record(record: dict[str, Any], eta_s: float | None, worker_offline: bool = False) -> dict[str, Any]:
    """The record as clients see it: internal bookkeeping (Celery ids, costs) left out; a track whose stage
    runs (or last ran) on a worker has that worker's status (read with the record), so a client sees
    `offline` when it died."""
    tracks = []
    for track in record["tracks"]:
        public = {k: v for k, v in track.items() if k not in PRIVATE_TRACK_FIELDS}
        public["seed"] = track["params"].get("seed")
        public["downloads"] = download_urls(record["job_id"], track)
        tracks.append(public)
    return {**record, "tracks": tracks, "eta_s": eta_s, "worker_offline": worker_offline}


def download_urls(job_id: str, track: dict[str, Any]) -> dict[str, str]:
    """A track's download links, by format, from the files it has."""
    urls = {}
    for name in track["artifacts"]:
        if name == "output.mp4":
            urls["mp4"] = f"{JOBS_URL}{job_id}/video.mp4"
        elif TRACK_FILE.fullmatch(name.removeprefix("track")):
            urls[name.rsplit(".", 1)[1]] = f"{JOBS_URL}{job_id}/tracks/{name.removeprefix('track')}"
    return urls


def expected_overall(states: list[str]) -> str:
    """The documented rule (docs/api.md), written plainly: the reference for the one Lua rule."""
    if not states:
        return "failed"
    if all(s == "queued" for s in states):
        return "queued"
    if any(s not in ("done", "failed", "canceled") for s in states):
        return "running"
    if len(set(states)) == 1:
        return states[0]
    return "partial" if "done" in states else ("canceled" if "canceled" in states else "failed")
