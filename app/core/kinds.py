"""Job kinds: the ordered stages each pipeline runs. The job/stage machinery is shared; only this differs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stage:
    name: str  # stage name, also the key of its time limit
    state: str  # the track state shown while this stage runs
    task: str  # Celery task name
    unit: str  # what its progress counts
    cpu: bool = False  # needs no GPU: runs on the host's CPU-stage worker when one is live (app/core/queues.py)


@dataclass(frozen=True)
class JobKind:
    name: str
    stages: tuple[Stage, ...]
    # Its stages pass intermediates through the shared artifact store, so a track moved to another worker can
    # resume at its first unfinished stage (music); else they sit in the worker's local scratch and a moved
    # track starts over (lip-sync's decoded frames).
    resumable: bool = False

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"{self.name} has no stage {name!r}")

    def next_stage(self, name: str) -> Stage | None:
        names = [stage.name for stage in self.stages]
        index = names.index(name)
        return self.stages[index + 1] if index + 1 < len(self.stages) else None


MUSIC = JobKind(
    "music",
    (
        Stage("backbone", "backbone", "encore.music.backbone", "tokens"),
        Stage("superres", "superres", "encore.music.superres", "layers"),
        Stage("decode", "decoding", "encore.music.decode", "chunks"),
        Stage("export", "exporting", "encore.music.export", "files", cpu=True),
    ),
    resumable=True,
)

LIPSYNC = JobKind(
    "lipsync",
    (
        Stage("prepare", "preparing", "encore.lipsync.prepare", "steps", cpu=True),
        Stage("lipsync", "lipsync", "encore.lipsync.lipsync", "frames"),
        Stage("mux", "muxing", "encore.lipsync.mux", "steps", cpu=True),
    ),
)

KINDS: dict[str, JobKind] = {MUSIC.name: MUSIC, LIPSYNC.name: LIPSYNC}

QUEUED, DONE, FAILED, CANCELED = "queued", "done", "failed", "canceled"
# A track in one of these states has ended: only a retry (failed, canceled) changes it again. The one definition:
# the lifecycle, the clients and the Lua scripts (its generated `TERMINAL` set, app/control/lifecycle.lua_stages)
# all read it.
TERMINAL_STATES = frozenset({DONE, FAILED, CANCELED})
# A job in one of these overall states has ended (`partial`: some tracks done, the rest failed or canceled).
JOB_END_STATES = TERMINAL_STATES | {"partial"}


def first_unfinished(kind: JobKind, stages: dict[str, Any]) -> int:
    """Index of the first stage of `kind` the track has not finished (the last when every one has: what a
    restart would run). The Lua scripts' `first_unfinished` (app/control/lua/tracks.lua) is the same rule."""
    for index, stage in enumerate(kind.stages):
        run = stages.get(stage.name)
        if not isinstance(run, dict) or not run.get("finished_at"):
            return index
    return len(kind.stages) - 1
