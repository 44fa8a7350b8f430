"""Lip-sync uploads: stream both files to disk, probe them, and reject bad input before anything is queued.

Werkzeug spools multipart files larger than 500 KB to temporary files, and the app's MAX_CONTENT_LENGTH
stops a body larger than both limits together before it is read; per-field limits are checked here.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from werkzeug.datastructures import FileStorage

from app.core.config import Settings
from app.pipeline.lipsync.frames import output_frame_count, source_frames_shown, source_frames_to_decode
from app.pipeline.media.ffmpeg import MediaError, MediaTools
from app.pipeline.media.probe import MediaInfo, effective_fps, measured_audio_s, probe
from app.pipeline.profiles import LipsyncProfile
from app.core.priority import DEFAULT_PRIORITY, Priority
from app.http.schemas import FieldError, describe_validation_error

FILE_FIELDS = ("video", "audio")
SAFE_EXTENSION = re.compile(r"^[a-z0-9]{1,5}$")
FPS_LIMIT = 120  # highest output frame rate the form takes
FPS_LEAST = 1  # lowest one (0 aside, which means the video's own): below it one frame would outlast any audio


class UploadError(Exception):
    def __init__(self, status: int, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.status, self.field, self.message = status, field, message


class LipsyncForm(BaseModel):
    """Optional form fields of POST /api/v1/lipsync (strings in the form, parsed as numbers)."""

    model_config = ConfigDict(extra="forbid")

    fps: float | None = Field(
        default=None,
        ge=0,
        le=FPS_LIMIT,
        description="output frame rate, 1 to 120; missing or 0 → the video's own (25 when unknown or above 120)",
        # 0, or from 1 (the document's spelling; `not` the range between broke schemathesis's form generation)
        json_schema_extra={
            "anyOf": [
                {"type": "number", "const": 0},
                {"type": "number", "minimum": FPS_LEAST, "maximum": FPS_LIMIT},
                {"type": "null"},
            ]
        },
    )
    extra_margin: int | None = Field(default=None, ge=0, le=200, description="pixels added below the face box")
    batch_size: int | None = Field(default=None, ge=1, le=256, description="frames per UNet batch")
    webhook: str | None = Field(
        default=None,
        max_length=2000,
        description="an http(s) URL that receives the job's events, signed the Standard Webhooks way",
    )
    webhook_events: str | None = Field(
        default=None,
        max_length=100,
        description="comma-separated: start, progress, completed, failed, canceled (default: all but progress)",
    )
    priority: Priority | None = Field(
        default=None,
        description="high, normal (the default) or low: orders the first "
        "stages of jobs waiting for a GPU; a started job's later stages still run first",
    )

    @field_validator("fps")
    @classmethod
    def _fps_is_a_frame_rate(cls, fps: float | None) -> float | None:
        if fps and fps < FPS_LEAST:
            raise FieldError("fps", f"must be 0 (the video's own rate) or from {FPS_LEAST} to {FPS_LIMIT}")
        return fps


@dataclass
class ReceivedUpload:
    params: dict[str, Any]
    files: dict[str, Path]  # field -> staged file
    staging: Path

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def receive_lipsync(
    form: dict[str, str], files: dict[str, FileStorage], settings: Settings, profile: LipsyncProfile
) -> ReceivedUpload:
    """Validate fields, stage both files, probe them; raises UploadError naming the field."""
    unknown = sorted(set(files) - set(FILE_FIELDS))
    if unknown:
        raise UploadError(400, unknown[0], "unknown file field (expected video and audio)")
    try:
        fields = LipsyncForm.model_validate({k: (v if v != "" else None) for k, v in form.items()})
    except ValidationError as exc:
        field, message = describe_validation_error(exc)
        raise UploadError(400, field, message) from None
    for name in FILE_FIELDS:
        if name not in files or not files[name].filename:
            raise UploadError(400, name, "file missing (multipart/form-data field)")
    settings.upload_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="upload-", dir=settings.upload_dir))
    received = ReceivedUpload(params={}, files={}, staging=staging)
    try:
        limits = {"video": settings.max_video_mb, "audio": settings.max_audio_mb}
        for name in FILE_FIELDS:
            received.files[name] = _stage(files[name], staging, name, limits[name])
        tools = MediaTools.of(settings)  # the web's ENCORE_FFPROBE
        video, audio = (_probe(received.files[n], n, tools) for n in FILE_FIELDS)
        video, audio = _measured(video, audio, received.files, settings, tools)
        fps, fps_from = output_fps(fields.fps, video.fps, profile.default_fps)
        _check_media(video, audio, settings, fps)
        received.params = _params(fields, fps, fps_from, video, audio, profile, received.files)
        return received
    except BaseException:
        received.discard()
        raise


def output_fps(requested: float | None, source: float | None, default: float) -> tuple[float, str]:
    """The output frame rate and where it came from: the request's, else the video's own (so its motion
    keeps its speed), else the profile's default when the probe gives none or one the form would refuse.
    0 means "not given", as missing does (MuseTalk's fps=0 bug)."""
    if requested:
        return requested, "request"
    if source is not None and 0 < source <= FPS_LIMIT:
        return source, "source"
    return default, "default"


def _stage(upload: FileStorage, staging: Path, field: str, limit_mb: float) -> Path:
    upload.stream.seek(0, 2)
    size = upload.stream.tell()
    upload.stream.seek(0)
    if size > limit_mb * 1024 * 1024:
        raise UploadError(413, field, f"file is {size / 2**20:.1f} MB; the limit is {limit_mb:g} MB")
    if size == 0:
        raise UploadError(400, field, "file is empty")
    extension = Path(upload.filename or "").suffix.lower().lstrip(".")
    target = staging / f"input_{field}.{extension if SAFE_EXTENSION.match(extension) else 'bin'}"
    upload.save(target)
    return target


def _probe(path: Path, field: str, tools: MediaTools) -> MediaInfo:
    try:
        return probe(path, tools=tools, count_packets=field == "video")
    except MediaError:
        raise UploadError(400, field, "cannot be read as audio/video (ffprobe failed)") from None


def _measured(
    video: MediaInfo, audio: MediaInfo, files: dict[str, Path], settings: Settings, tools: MediaTools
) -> tuple[MediaInfo, MediaInfo]:
    """The two probes with their lengths replaced by what the streams really hold: the video's length is its
    frames, counted from its packets by the probe (`count_packets`), over its frame rate; the audio's seconds are
    counted in decoded samples (up to the limit and one second). A header's durations and frame count are never
    trusted for a limit."""
    if video.has_video:
        seconds = video.frame_count / effective_fps(video)
        video = replace(video, video_duration_s=seconds, duration_s=seconds)
    if audio.has_audio:
        try:
            seconds = measured_audio_s(files["audio"], limit_s=settings.max_audio_s, tools=tools)
        except MediaError:
            raise UploadError(400, "audio", "cannot be decoded as audio") from None
        audio = replace(audio, audio_duration_s=seconds, duration_s=seconds)
    return video, audio


def _check_media(video: MediaInfo, audio: MediaInfo, settings: Settings, fps: float) -> None:
    if not video.has_video:
        raise UploadError(400, "video", "has no video stream")
    pixels = (video.width or 0) * (video.height or 0)
    if pixels > settings.max_video_pixels:
        raise UploadError(
            400,
            "video",
            f"is {video.width}x{video.height} ({pixels} pixels); the limit is "
            f"{settings.max_video_pixels} pixels (4096x2160 by default)",
        )
    if not audio.has_audio:
        raise UploadError(400, "audio", "has no audio stream")
    video_seconds = video.video_duration_s or video.duration_s or 0.0
    if video_seconds < settings.min_video_s:
        raise UploadError(400, "video", f"is {video_seconds:.2f} s long; at least {settings.min_video_s:g} s needed")
    if video_seconds > settings.max_video_s:
        raise UploadError(
            400,
            "video",
            f"is {video_seconds:.1f} s long ({video.frame_count} frames); the limit is {settings.max_video_s:g} s",
        )
    work = video.frame_count * pixels
    if work > settings.max_video_frame_pixels:
        raise UploadError(
            400,
            "video",
            f"holds {video.frame_count} frames of {video.width}x{video.height}: "
            f"{work:.3g} pixels to decode; the limit is {settings.max_video_frame_pixels:.3g}",
        )
    audio_seconds = audio.audio_duration_s or audio.duration_s or 0.0
    shortest = max(settings.min_audio_s, 1.0 / fps)
    if audio_seconds < shortest:
        raise UploadError(400, "audio", f"is {audio_seconds:.2f} s long; at least {shortest:g} s needed")
    if audio_seconds > settings.max_audio_s:
        longer = "longer than " if audio_seconds >= settings.max_audio_s + 1 else ""  # decoding stopped there
        raise UploadError(
            400, "audio", f"is {longer}{audio_seconds:.1f} s long (decoded); the limit is {settings.max_audio_s:g} s"
        )
    shown = min(
        video.frame_count,
        source_frames_to_decode(source_frames_shown(output_frame_count(audio_seconds, fps), video.fps, fps)),
    )  # what the worker decodes
    scratch_mb = shown * pixels * 3 / 2**20
    if scratch_mb > settings.max_scratch_mb:
        raise UploadError(
            400,
            "video",
            f"the {shown} frames of {video.width}x{video.height} this output reads would "
            f"take {scratch_mb:.0f} MiB of worker scratch; the limit is "
            f"{settings.max_scratch_mb:g} MiB",
        )


def _params(
    fields: LipsyncForm,
    fps: float,
    fps_from: str,
    video: MediaInfo,
    audio: MediaInfo,
    profile: LipsyncProfile,
    files: dict[str, Path],
) -> dict[str, Any]:
    audio_seconds = audio.audio_duration_s or audio.duration_s
    return {
        "fps": fps,
        "source_fps": video.fps,
        "fps_from": fps_from,
        "extra_margin": fields.extra_margin if fields.extra_margin is not None else profile.default_extra_margin,
        "batch_size": fields.batch_size,  # None: the worker's default for its device (LipsyncModels.batch_size)
        "audio_duration_s": audio_seconds,
        "video_duration_s": video.video_duration_s or video.duration_s,
        "video_fps": video.fps,
        "video_frames": video.frame_count,
        "width": video.width,
        "height": video.height,
        "output_frames": output_frame_count(audio_seconds, fps),
        "inputs": {name: path.name for name, path in files.items()},
        "profile": profile.name,
        "priority": fields.priority or DEFAULT_PRIORITY,
    }
