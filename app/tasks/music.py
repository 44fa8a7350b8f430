"""Music stage tasks: thin wrappers that hand job parameters and artifact paths to app.pipeline.music.stages.

The pipeline (torch, megatron-core, the codec) is imported inside the pool child only: megatron-core
initialises CUDA when imported, and a prefork master that did so hands its children a CUDA context that
breaks after fork ("Cannot re-initialize CUDA in forked subprocess", seen on an H200).
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import TYPE_CHECKING

from app.core.kinds import MUSIC
from app.control.eta import announce_slots
from app.control.services import services
from app.tasks.stage import StageRun, stage_task

if TYPE_CHECKING:
    from app.pipeline.music.stages import MusicModels


def stage_code():
    """The music pipeline's stage code, imported on first use (it pulls in torch and model code: seconds)."""
    from app.pipeline.music import stages

    return stages


@lru_cache(maxsize=1)
def models() -> "MusicModels":
    """This worker child's models (created on first use, after fork)."""
    settings = services().settings
    return stage_code().MusicModels(
        settings.music(), settings.runtime_mode, engine=settings.music_engine, song_margin_s=settings.song_margin_s
    )


def preload() -> None:
    """Load the resident models now (ENCORE_PRELOAD=1), so the first job pays no load time."""
    cache = models()
    cache.tokenizer()
    cache.backbone()
    if cache.cache.mode == "keep_loaded":
        cache.superres()
        cache.codec()


def _names(run: StageRun) -> dict[str, str]:
    t = run.track
    return {
        "coarse": f"track{t}.coarse.pt",
        "fine": f"track{t}.fine.pt",
        "wav": f"track{t}.wav",
        "mp3": f"track{t}.mp3",
        "meta": f"track{t}.json",
    }


def _seed(run: StageRun) -> int:
    return int(run.track_params["seed"])


def backbone_work(run: StageRun) -> None:
    """The in-flight engine when this worker runs one (app/tasks/engine.py), else `batched_backbone_work`."""
    slots = engine_slots(run)
    if slots > 1:
        from app.pipeline.music.inflight import InFlightBackbone
        from app.tasks.engine import BackboneEngine

        assert run.watch is not None
        batched = run.svc.settings.engine_matmul == "batched"
        graphs = run.svc.settings.engine_graphs
        runner = InFlightBackbone(models(), slots, run.loaded, batched_matmul=batched, cuda_graphs=graphs)
        announce_slots(run.svc, run.queue, runner.slots)  # halved on out-of-memory: the ones it has
        BackboneEngine(run, run.watch, runner).serve()
        return
    announce_slots(run.svc, run.queue, 1)
    batched_backbone_work(run)


def engine_slots(run: StageRun) -> int:
    """This child's engine slots (ENCORE_BACKBONE_SLOTS, sized once from free memory when 0); 1 when there is no
    engine: the setting says 1, or the backbone engine is not the plain-PyTorch one (Megatron's own forward is the
    reference path)."""
    setting = run.svc.settings.backbone_slots
    if setting == 1:
        return 1
    from app.pipeline.music import inflight
    from app.pipeline.music.torch_engine import TorchCausalLM

    lm = models().backbone(run.loaded, run.control)  # its load is announced on this track, as the stage's alone
    if not isinstance(lm, TorchCausalLM):
        return 1
    models().tokenizer(run.loaded, run.control)
    if setting not in _SIZED:  # sized once per child: free memory shrinks as the engine allocates its cache
        _SIZED[setting] = inflight.engine_slots(lm, setting)
    return _SIZED[setting]


_SIZED: dict[int, int] = {}


def batched_backbone_work(run: StageRun) -> None:
    """The track's coarse codes, and those of up to ENCORE_BATCH_TRACKS - 1 other tracks of the song waiting
    on this queue, in one batch when the engine batches (on the torch engine a slot decoder of one slot per
    track: the linear layers run per track, the rest of each step once). Written for tracks of any job (TrackRef
    pairs); the candidates are the song's own tracks."""
    batch = run.svc.settings.batch_tracks
    batches = batch > 1 and models().backbone_batches(run.loaded, run.control)  # a load here is announced
    adopted = run.adopt_waiting_siblings(batch - 1) if batches else []
    refs = [run.ref, *adopted]
    seeds = [int(run.params_of(ref)["seed"]) if ref != run.ref else _seed(run) for ref in refs]
    names = [f"track{ref.track}.coarse.pt" for ref in refs]
    outs = [run.workdir / f"{ref.job_id}-{name}" for ref, name in zip(refs, names, strict=True)]  # jobs may share
    started = time.time()
    try:
        info = stage_code().run_backbone_tracks(
            models(), run.params, seeds, outs, run.shared_control(adopted), run.loaded
        )
    except BaseException:
        run.release_adopted(adopted)
        raise
    for ref, name, out in zip(refs, names, outs, strict=True):
        run.svc.artifacts.put(ref.job_id, name, out, run.ttl_of(ref))
    for ref, song in zip(refs, info.pop("songs"), strict=True):  # the song's actual length, known from here on
        run.note(ref, song=song)
    for ref in adopted:
        run.finish_adopted(ref, started)
    run.info.update(info, **({"with_tracks": [ref.track for ref in adopted]} if adopted else {}))
    models().after_stage("backbone")


def superres_work(run: StageRun) -> None:
    names = _names(run)
    out = run.workdir / names["fine"]
    stage_code().run_superres(
        models(), run.params, _seed(run), run.input(names["coarse"]), out, run.control, run.loaded
    )
    run.keep(out.name, out)
    models().after_stage("superres")


def decode_work(run: StageRun) -> None:
    names = _names(run)
    out = run.workdir / names["wav"]
    stage_code().run_decode(models(), run.input(names["fine"]), out, run.control, run.loaded)
    run.publish(out.name, out)
    models().after_stage("decode")


def export_work(run: StageRun) -> None:
    names = _names(run)
    mp3, meta = run.workdir / names["mp3"], run.workdir / names["meta"]
    record = run.svc.jobs.track(run.job_id, run.track) or {}
    metadata = stage_code().metadata_json(run.params, _seed(run), models().profile, record.get("song"))
    stage_code().run_export(
        run.input(names["wav"]),
        mp3,
        meta,
        {**metadata, "job_id": run.job_id, "track": run.track},
        run.control,
        tools=run.svc.media,
        ffmpeg_timeout_s=run.svc.settings.ffmpeg_timeout_s,
    )
    run.publish(mp3.name, mp3)
    run.publish(meta.name, meta)


backbone = stage_task(MUSIC, "backbone", backbone_work)
superres = stage_task(MUSIC, "superres", superres_work)
decode = stage_task(MUSIC, "decode", decode_work)
export = stage_task(MUSIC, "export", export_work)
