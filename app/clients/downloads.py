"""Saving a finished job's results: every file of every done track, under the names the CLI and the demo
promise (track<i>.<fmt> for music, lipsync.mp4), each streamed through a .part file by `Client.download`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.clients.http_client import Client


def output_name(kind: str, track: int, fmt: str) -> str:
    return "lipsync.mp4" if kind == "lipsync" and fmt == "mp4" else f"track{track}.{fmt}"


def download_results(client: Client, record: dict[str, Any], out: Path) -> list[Path]:
    """Every file of every finished track, named track<i>.<fmt> (music) or lipsync.mp4."""
    out.mkdir(parents=True, exist_ok=True)
    saved = []
    for track in record["tracks"]:
        if track["state"] != "done":
            continue
        for fmt, url in sorted(track.get("downloads", {}).items()):
            target = out / output_name(record["kind"], track["track"], fmt)
            client.download(url, target)
            saved.append(target)
    return saved
