"""Worker-local folders: a track's scratch (shared by its stages on one host) and each stage's own workdir, and
the sweeps that remove what a killed process or an expired job left behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from app.control.services import Services
from app.control.workers import pid_alive
from app.core.kinds import TERMINAL_STATES


def track_scratch(svc: Services, job_id: str, track: int) -> Path:
    return svc.settings.worker_cache_dir / "tracks" / f"{job_id}-{track}"


def drop_scratch(svc: Services, job_id: str, track: int) -> None:
    shutil.rmtree(track_scratch(svc, job_id, track), ignore_errors=True)


def sweep_scratch(svc: Services) -> list[str]:
    """Scratch folders of tracks that ended (done, failed, canceled: also while the worker that held them was dead,
    which could not clean up) or whose job expired; run on every heartbeat. A retried track starts again from
    what the artifact store keeps, never from this host's scratch."""
    root = svc.settings.worker_cache_dir / "tracks"
    folders = [(folder, *folder.name.rpartition("-")[::2]) for folder in (root.iterdir() if root.is_dir() else [])]
    pipe = svc.redis.pipeline(transaction=False)  # one round trip for the host's folders: it runs every beat
    for _, job_id, track in folders:
        pipe.hget(svc.jobs.keys.track(job_id, int(track)) if job_id and track.isdigit() else "", "status")  # "": none
    removed = []
    for (folder, _, _), status in zip(folders, pipe.execute() if folders else [], strict=True):
        if status is None or status in TERMINAL_STATES:  # no such track (its job expired), or it ended
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed


def stage_workdir(svc: Services, job_id: str, track: int, stage: str) -> Path:
    """A running stage's own temp folder, under the worker's cache dir and named after its job, track, stage and
    process: removed when the stage ends, and by `sweep_workdirs` when its process was killed first."""
    root = svc.settings.worker_cache_dir / "work"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{job_id}-{track}-{stage}-{os.getpid()}-", dir=root))


def sweep_workdirs(svc: Services) -> list[str]:
    """Temp folders of stages whose process is gone (a killed pool child or worker cannot clean up after itself);
    a folder whose process lives, even one of another worker on this host, is kept."""
    root = svc.settings.worker_cache_dir / "work"
    removed = []
    for folder in root.iterdir() if root.is_dir() else []:
        parts = folder.name.rsplit("-", 2)
        if len(parts) == 3 and parts[1].isdigit() and not pid_alive(int(parts[1])):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed
