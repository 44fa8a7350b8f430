"""The lip-sync pipeline's three stages as plain functions over a track's scratch folder:
prepare (probe, 16 kHz audio, frames decoded once, faces) → lipsync (MuseTalk) → mux (ffmpeg).

The scratch folder is worker-local (every stage of a track runs on the same queue): decoded frames are too
big for the artifact store. The source video is never looped or re-encoded before inference.
"""

from __future__ import annotations

import hashlib
import json
import wave
from pathlib import Path
from typing import Any

from app.pipeline.control import StageControl
from app.pipeline.lipsync import faces, inference, musetalk
from app.pipeline.lipsync.frames import (
    output_frame_count,
    shows_a_frame_twice,
    source_frames_shown,
    source_frames_to_decode,
)
from app.pipeline.lipsync.options import LIPSYNC_MASKS
from app.pipeline.lipsync.source_cache import SourceCache, entry_key, file_digest
from app.pipeline.media.decode import FrameCache, decode_frames, extract_audio
from app.pipeline.media.encode import VideoWriter
from app.pipeline.media.ffmpeg import ON_PATH, MediaTools
from app.pipeline.media.mux import mux
from app.pipeline.media.probe import probe
from app.pipeline.profiles import LipsyncProfile
from app.pipeline.runtime import ModelCache

FRAMES, FRAMES_META, FACES, AUDIO_16K, PICTURE = "frames.u8", "frames.json", "faces.json", "audio16k.wav", "picture.mp4"
PLAN = "plan.json"


def loading_detail(label: str) -> str:
    """The detail the lipsync stage reports while it loads MuseTalk, and only then (the words of
    app/pipeline/music/stages.loading_detail: a client says "loading" from a detail that starts "loading ")."""
    return f"loading {label} model"


class LipsyncModels:
    """The MuseTalk models of one profile, held in a ModelCache under the worker's runtime mode, loaded in
    `precision` (ENCORE_LIPSYNC_PRECISION: auto, fp16 or fp32; see musetalk.resolve_dtype)."""

    def __init__(self, profile: LipsyncProfile, mode: str, device: str | None = None, precision: str = "auto"):
        import torch

        self.profile = profile
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.precision = precision
        # one_shot frees nothing resident here: MuseTalk is one model set used by one stage.
        self.cache = ModelCache(mode, frozenset({"musetalk"}))

    def musetalk(self, loaded: list[str] | None = None, control: StageControl | None = None) -> musetalk.MuseTalkModels:
        """The MuseTalk models; a load (only when they are absent) reports `loading_detail` through `control`,
        so the stage says "loading" exactly when it loads (never after ENCORE_PRELOAD)."""

        def load() -> musetalk.MuseTalkModels:
            if control is not None:
                control.report(0.0, loading_detail("MuseTalk"))
            return musetalk.load_musetalk(self.profile, self.device, precision=self.precision)

        return self.cache.get("musetalk", load, loaded)

    def batch_size(self) -> int:
        """Frames per UNet batch when the request names none: the profile's measured size for the device."""
        return self.profile.cuda_batch_size if self.device.startswith("cuda") else self.profile.default_batch_size

    def warm_up(self) -> float:
        """One batch of zeros through whisper, the VAE and the UNet at the default batch size, so the first
        job does not pay for first-call kernel choices (cuDNN's benchmark) and lazy initialisation; seconds."""
        import time

        import torch

        engine, size, started = self.musetalk(), self.batch_size(), time.perf_counter()
        with torch.inference_mode():
            inference.whisper_hidden_states(engine, inference.np.zeros(musetalk.WHISPER_SAMPLE_RATE, "float32"))
            pixels = torch.zeros(size, 3, engine.crop_size, engine.crop_size, device=engine.device)
            latents = inference.encode_pixels(engine, pixels)
            prompts = torch.zeros(
                size,
                2 * (self.profile.audio_padding_left + self.profile.audio_padding_right + 1) * engine.audio_layers,
                engine.audio_dim,
                device=engine.device,
            )
            inference.redraw_faces(engine, latents, prompts)
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
        return time.perf_counter() - started


def run_prepare(
    video: Path,
    audio: Path,
    fps: float,
    scratch: Path,
    control: StageControl,
    timeout_s: float,
    *,
    cache: SourceCache | None = None,
    face_threads: int = 1,
    tools: MediaTools = ON_PATH,
    max_scratch_bytes: int | None = None,
) -> dict[str, Any]:
    """16 kHz mono audio for whisper, every source frame decoded once, one face per frame (landmarks and
    MuseTalk's box, faces.find_faces, on `face_threads` threads; from the source cache when this video was
    seen before), and the plan: the exact audio duration (from the decoded samples: container durations of
    MP3 run long) and hence the output frame count floor(audio s x fps). Only the source frames the output
    shows are decoded and searched (frames.source_frames_shown, rounded up by frames.source_frames_to_decode),
    within `max_scratch_bytes` of frames."""
    control.check()
    extract_audio(audio, scratch / AUDIO_16K, timeout_s=timeout_s, tools=tools)
    with wave.open(str(scratch / AUDIO_16K)) as decoded:
        audio_seconds = decoded.getnframes() / decoded.getframerate()
    plan = {
        "audio_duration_s": audio_seconds,
        "fps": fps,
        "output_frames": output_frame_count(audio_seconds, fps),
        "video_sha256": file_digest(video),
    }
    (scratch / PLAN).write_text(json.dumps(plan))
    info = probe(video, tools=tools)
    shown = source_frames_shown(plan["output_frames"], info.fps, fps)
    frames = decode_frames(
        video,
        scratch / FRAMES,
        control=control.part(0.0, 0.5, "decoding"),
        tools=tools,
        max_frames=source_frames_to_decode(shown),
        max_bytes=max_scratch_bytes,
        info=info,
    )
    key = entry_key(
        "faces",
        video=plan["video_sha256"],
        frames=len(frames),
        version=faces.FACE_PIPELINE_VERSION,
        landmarks=faces.landmarks_available(),
    )
    cached = cache.read_json(key) if cache is not None else None
    try:
        if cached is not None:
            track = faces.FaceTrack.from_json(cached)
        else:  # or NoFaceDetected
            track = faces.find_faces(frames, threads=face_threads, control=control.part(0.5, 1.0, "finding faces"))
    finally:
        frames.close()
    if cached is None and cache is not None:
        cache.write_json(key, track.to_json())
    (scratch / FRAMES_META).write_text(
        json.dumps({"count": len(track.boxes), "height": frames.height, "width": frames.width, "fps": frames.fps})
    )
    (scratch / FACES).write_text(json.dumps(track.to_json()))
    return {
        "source_frames": len(track.boxes),
        "frames_with_face": track.frames_with_face,
        "faces": track.method,
        "shots": len(track.cuts),
        "cache": _cache_state(cache, cached is not None),
        **{k: v for k, v in plan.items() if k != "video_sha256"},
    }


def _cache_state(cache: SourceCache | None, hit: bool, partly: bool = False) -> str:
    """What a stage record says of the source cache: off, miss, hit, or partial (some source frames' latents
    were kept, others had to be encoded: an earlier job on the video used fewer of its frames)."""
    return "off" if cache is None else "partial" if partly else "hit" if hit else "miss"


def _open_frames(scratch: Path) -> FrameCache:
    meta = json.loads((scratch / FRAMES_META).read_text())
    return FrameCache(scratch / FRAMES, meta["count"], meta["height"], meta["width"], meta["fps"])


def run_lipsync_stage(
    models: LipsyncModels,
    params: dict[str, Any],
    scratch: Path,
    control: StageControl,
    loaded: list[str] | None = None,
    mask: str = "jaw",
    *,
    path: str = "device",
    cache: SourceCache | None = None,
    tools: MediaTools = ON_PATH,
) -> dict[str, Any]:
    """MuseTalk over floor(audio s x fps) frames into a picture-only MP4 at the output fps. The source is
    resampled from its own fps (frames.json, as decoded) to the output's, and cycled ping-pong when the audio
    is longer; the audio windows follow the output fps. Blended through the `mask` mode ("jaw" needs
    landmarks; without them the rectangle is used), the per-frame work done the `path` way
    (inference.run_lipsync). The source frames' VAE latents come from the source cache when this video was
    seen with the same faces, VAE, dtype and crop settings, and go into it otherwise."""
    if mask not in LIPSYNC_MASKS:
        raise ValueError(f"mask must be one of {LIPSYNC_MASKS}, not {mask!r}")
    engine = models.musetalk(loaded, control)
    profile, plan = models.profile, _plan(scratch)
    frames_out, batch_size = plan["output_frames"], int(params.get("batch_size") or models.batch_size())
    features = inference.audio_windows(
        engine,
        scratch / AUDIO_16K,
        fps=params["fps"],
        num_frames=frames_out,
        padding_left=profile.audio_padding_left,
        padding_right=profile.audio_padding_right,
    )
    faces_json = (scratch / FACES).read_bytes()
    track = faces.FaceTrack.from_json(json.loads(faces_json))
    landmarks = track.landmarks if mask == "jaw" else None
    key = entry_key(
        "latents",
        video=plan.get("video_sha256"),
        faces=hashlib.sha256(faces_json).hexdigest(),
        margin=int(params["extra_margin"]),
        crop=engine.crop_size,
        vae=musetalk.vae_identity(profile),
        dtype=musetalk.precision_name(engine.dtype),
        path=path,
    )
    with (
        _open_frames(scratch) as frames,
        VideoWriter(
            scratch / PICTURE, width=frames.width, height=frames.height, fps=params["fps"], tools=tools
        ) as writer,
    ):
        keep = (cache is not None or shows_a_frame_twice(frames_out, len(frames), frames.fps, params["fps"])) and len(
            frames
        ) <= inference.MAX_KEPT_SOURCE_FRAMES
        kept = cache.read_latents(key) if cache is not None and keep else {}
        latents = inference.SourceLatents(engine, keep=keep, kept=kept)
        written = inference.run_lipsync(
            engine,
            frames,
            track.boxes,
            features,
            num_frames=frames_out,
            batch_size=batch_size,
            extra_margin=int(params["extra_margin"]),
            sink=writer.write,
            control=control,
            fps=params["fps"],
            source_fps=frames.fps,
            landmarks=landmarks,
            path=path,
            latents=latents,
        )
        source_frames, source_fps = len(frames), frames.fps
    if cache is not None and keep and latents.encoded:
        cache.write_latents(key, latents.kept)
    return {
        "profile": profile.name,
        "frames_generated": written,
        "source_frames": source_frames,
        "source_fps": source_fps,
        "encoder": writer.encoder,
        "precision": musetalk.precision_name(engine.dtype),
        "mask": "jaw" if landmarks is not None else "rectangle",
        "faces": track.method,
        "path": path,
        "batch_size": batch_size,
        "latents_encoded": latents.encoded,
        "cache": _cache_state(cache, bool(kept), partly=bool(kept) and latents.encoded > 0),
    }


def _plan(scratch: Path) -> dict[str, Any]:
    return json.loads((scratch / PLAN).read_text())


def run_mux(
    scratch: Path,
    driving_audio: Path,
    out: Path,
    control: StageControl,
    timeout_s: float,
    *,
    tools: MediaTools = ON_PATH,
) -> dict[str, Any]:
    """Picture from the lip-sync output, sound only from the driving audio."""
    plan = _plan(scratch)
    control.step(0, 1, "files")
    mux(
        scratch / PICTURE,
        driving_audio,
        out,
        audio_duration_s=plan["audio_duration_s"],
        picture_duration_s=plan["output_frames"] / plan["fps"],
        timeout_s=timeout_s,
        tools=tools,
    )
    control.step(1, 1, "files")
    info = probe(out, tools=tools)
    return {"duration_s": info.duration_s, "frames": info.frame_count}
