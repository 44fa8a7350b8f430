"""The lip-sync pipeline's three stages as plain functions over a track's scratch folder:
prepare (probe, 16 kHz audio, frames decoded once, faces) → lipsync (MuseTalk) → mux (ffmpeg).

The scratch folder is worker-local (every stage of a track runs on the same queue): decoded frames are too
big for the artifact store. The source video is never looped or re-encoded before inference.
"""
from __future__ import annotations

import json
import wave
from pathlib import Path
from typing import Any

from app.config import LIPSYNC_MASKS
from app.pipeline.control import StageControl
from app.pipeline.lipsync import faces, inference, musetalk
from app.pipeline.lipsync.frames import output_frame_count
from app.pipeline.media.decode import FrameCache, decode_frames, extract_audio
from app.pipeline.media.encode import VideoWriter
from app.pipeline.media.mux import mux
from app.pipeline.media.probe import probe
from app.pipeline.profiles import LipsyncProfile
from app.pipeline.runtime import ModelCache

FRAMES, FRAMES_META, FACES, AUDIO_16K, PICTURE = "frames.u8", "frames.json", "faces.json", "audio16k.wav", "picture.mp4"
PLAN = "plan.json"


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

    def musetalk(self, loaded: list[str] | None = None) -> musetalk.MuseTalkModels:
        return self.cache.get("musetalk", lambda: musetalk.load_musetalk(self.profile, self.device,
                                                                         precision=self.precision), loaded)


def run_prepare(video: Path, audio: Path, fps: float, scratch: Path, control: StageControl,
                timeout_s: float) -> dict[str, Any]:
    """16 kHz mono audio for whisper, every source frame decoded once, one face per frame (landmarks and
    MuseTalk's box, faces.find_faces), and the plan: the exact audio duration (from the decoded samples:
    container durations of MP3 run long) and hence the output frame count floor(audio s x fps)."""
    control.check()
    extract_audio(audio, scratch / AUDIO_16K, timeout_s=timeout_s)
    with wave.open(str(scratch / AUDIO_16K)) as decoded:
        audio_seconds = decoded.getnframes() / decoded.getframerate()
    plan = {"audio_duration_s": audio_seconds, "fps": fps, "output_frames": output_frame_count(audio_seconds, fps)}
    (scratch / PLAN).write_text(json.dumps(plan))
    cache = decode_frames(video, scratch / FRAMES, control=control.part(0.0, 0.5, "decoding"))
    try:
        track = faces.find_faces(cache, control=control.part(0.5, 1.0, "finding faces"))  # or NoFaceDetected
    finally:
        cache.close()
    (scratch / FRAMES_META).write_text(json.dumps({"count": len(track.boxes), "height": cache.height,
                                                    "width": cache.width, "fps": cache.fps}))
    (scratch / FACES).write_text(json.dumps(track.to_json()))
    return {"source_frames": len(track.boxes), "frames_with_face": track.frames_with_face,
            "faces": track.method, "shots": len(track.cuts), **plan}


def _open_frames(scratch: Path) -> FrameCache:
    meta = json.loads((scratch / FRAMES_META).read_text())
    return FrameCache(scratch / FRAMES, meta["count"], meta["height"], meta["width"], meta["fps"])


def run_lipsync_stage(models: LipsyncModels, params: dict[str, Any], scratch: Path, control: StageControl,
                      loaded: list[str] | None = None, mask: str = "jaw") -> dict[str, Any]:
    """MuseTalk over floor(audio s x fps) frames into a picture-only MP4 at the output fps. The source is
    resampled from its own fps (frames.json, as decoded) to the output's, and cycled ping-pong when the audio
    is longer; the audio windows follow the output fps. Blended through the `mask` mode ("jaw" needs
    landmarks; without them the rectangle is used)."""
    if mask not in LIPSYNC_MASKS:
        raise ValueError(f"mask must be one of {LIPSYNC_MASKS}, not {mask!r}")
    engine = models.musetalk(loaded)
    profile = models.profile
    frames_out = _plan(scratch)["output_frames"]
    features = inference.audio_features(engine, scratch / AUDIO_16K, fps=params["fps"], num_frames=frames_out,
                                        padding_left=profile.audio_padding_left,
                                        padding_right=profile.audio_padding_right)
    track = faces.FaceTrack.from_json(json.loads((scratch / FACES).read_text()))
    landmarks = track.landmarks if mask == "jaw" else None
    with _open_frames(scratch) as frames, VideoWriter(scratch / PICTURE, width=frames.width,
                                                     height=frames.height, fps=params["fps"]) as writer:
        written = inference.run_lipsync(engine, frames, track.boxes, features, num_frames=frames_out,
                                        batch_size=int(params["batch_size"]), extra_margin=int(params["extra_margin"]),
                                        sink=writer.write, control=control, fps=params["fps"],
                                        source_fps=frames.fps, landmarks=landmarks)
        source_frames, source_fps = len(frames), frames.fps
    return {"frames_generated": written, "source_frames": source_frames, "source_fps": source_fps,
            "encoder": writer.encoder, "precision": musetalk.precision_name(engine.dtype),
            "mask": "jaw" if landmarks is not None else "rectangle", "faces": track.method}


def _plan(scratch: Path) -> dict[str, Any]:
    return json.loads((scratch / PLAN).read_text())


def run_mux(scratch: Path, driving_audio: Path, out: Path, control: StageControl,
            timeout_s: float) -> dict[str, Any]:
    """Picture from the lip-sync output, sound only from the driving audio."""
    plan = _plan(scratch)
    control.step(0, 1, "files")
    mux(scratch / PICTURE, driving_audio, out, audio_duration_s=plan["audio_duration_s"],
        picture_duration_s=plan["output_frames"] / plan["fps"], timeout_s=timeout_s)
    control.step(1, 1, "files")
    info = probe(out)
    return {"duration_s": info.duration_s, "frames": info.frame_count}
