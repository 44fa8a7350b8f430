"""Lip-sync stage tasks: thin wrappers that hand job parameters and paths to app.pipeline.lipsync.stages.

As for music, the pipeline (torch, diffusers) is imported in the pool child only, never in the master.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from app.core.kinds import LIPSYNC
from app.pipeline.profiles import load_lipsync_profile
from app.control.services import services
from app.tasks.stage import StageRun, stage_task

if TYPE_CHECKING:
    from app.pipeline.lipsync.stages import LipsyncModels

OUTPUT = "output.mp4"


def stage_code():
    """The lip-sync pipeline's stage code, imported on first use (it pulls in torch and model code: seconds)."""
    from app.pipeline.lipsync import stages

    return stages


def _faces():
    from app.pipeline.lipsync import faces

    return faces


@lru_cache(maxsize=1)
def models() -> "LipsyncModels":
    settings = services().settings
    profile = load_lipsync_profile(settings.lipsync_profile, settings.lipsync_model_dir)
    return stage_code().LipsyncModels(profile, settings.runtime_mode, precision=settings.lipsync_precision)


def preload() -> None:
    models().musetalk()
    if services().settings.lipsync_warmup:
        models().warm_up()


def source_cache():
    """The worker-local per-source-video cache (None when ENCORE_LIPSYNC_CACHE_MB is 0)."""
    from app.pipeline.lipsync.source_cache import SourceCache

    settings = services().settings
    size = int(settings.lipsync_cache_mb * 2**20)
    return SourceCache(settings.worker_cache_dir / "lipsync-sources", size) if size else None


def _input(run: StageRun, field: str):
    return run.input(run.params["inputs"][field])


def prepare_work(run: StageRun) -> None:
    settings = run.svc.settings
    run.info.update(
        stage_code().run_prepare(
            _input(run, "video"),
            _input(run, "audio"),
            run.params["fps"],
            run.scratch,
            run.control,
            settings.ffmpeg_timeout_s,
            cache=source_cache(),
            face_threads=settings.face_threads or _faces().default_threads(),
            tools=run.svc.media,
            max_scratch_bytes=int(settings.max_scratch_mb * 2**20),
        )
    )


def lipsync_work(run: StageRun) -> None:
    settings = run.svc.settings
    run.info.update(
        stage_code().run_lipsync_stage(
            models(),
            run.params,
            run.scratch,
            run.control,
            run.loaded,
            mask=settings.lipsync_mask,
            path=settings.lipsync_path,
            cache=source_cache(),
            tools=run.svc.media,
        )
    )
    models().cache.after_stage(["musetalk"])


def mux_work(run: StageRun) -> None:
    out = run.workdir / OUTPUT
    run.info.update(
        stage_code().run_mux(
            run.scratch, _input(run, "audio"), out, run.control, run.svc.settings.ffmpeg_timeout_s, tools=run.svc.media
        )
    )
    run.publish(OUTPUT, out)


prepare = stage_task(LIPSYNC, "prepare", prepare_work)
lipsync = stage_task(LIPSYNC, "lipsync", lipsync_work)
mux = stage_task(LIPSYNC, "mux", mux_work)
