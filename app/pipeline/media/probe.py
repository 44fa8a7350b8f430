"""What ffprobe says about a media file: streams, durations, displayed size, frame rate and count.

Uploads are checked with it (app/http/uploads.py) and every lip-sync stage sizes its work by it; anything ffprobe
cannot parse is refused with a `MediaError` saying so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional

from app.pipeline.media.ffmpeg import BASE_ARGS, ON_PATH, MediaError, MediaTools, PathLike, run

PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class MediaInfo:
    """What ffprobe says about a file. width/height are the *displayed* size (rotation applied), which is
    what decode_frames yields; fps is avg_frame_rate (None when unknown, e.g. "0/0")."""

    duration_s: float
    has_video: bool
    has_audio: bool
    width: int = 0
    height: int = 0
    fps: Optional[float] = None
    frame_count: int = 0
    video_codec: Optional[str] = None
    audio_codec: Optional[str] = None
    rotation: int = 0
    audio_duration_s: Optional[float] = None
    video_duration_s: Optional[float] = None
    audio_sample_rate: Optional[int] = None
    audio_channels: Optional[int] = None
    fps_exact: Optional[str] = None  # avg_frame_rate as "num/den", for writers that must keep the exact rate


def effective_fps(info: MediaInfo, default: float = 25.0) -> float:
    """fps to use for a clip: its own, or `default` when ffprobe reports 0/unknown (seen on some uploads)."""
    return info.fps if info.fps and info.fps > 0 else default


def _ratio(text: Optional[str]) -> Optional[float]:
    if not text or text in ("0/0", "N/A"):
        return None
    try:
        value = float(Fraction(text))
    except (ValueError, ZeroDivisionError):
        return None
    return value if value > 0 and math.isfinite(value) else None


def _float(value: Any) -> Optional[float]:
    try:
        result = float(value)
    except (TypeError, ValueError):
        return None
    return result if math.isfinite(result) and result >= 0 else None


def _tag_duration(stream: dict) -> Optional[float]:
    """Matroska/WebM keep per-stream duration only as a "HH:MM:SS.fff" tag."""
    text = (stream.get("tags") or {}).get("DURATION")
    if not text:
        return None
    try:
        hours, minutes, seconds = text.split(":")
        return int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    except ValueError:
        return None


def _stream_duration(stream: Optional[dict]) -> Optional[float]:
    if stream is None:
        return None
    return _float(stream.get("duration")) or _tag_duration(stream)


def _rotation(stream: dict) -> int:
    """Clockwise display rotation in degrees (0/90/180/270) from the display matrix or the old rotate tag."""
    angle: Optional[float] = None
    for side in stream.get("side_data_list") or []:
        if "rotation" in side:
            angle = -float(side["rotation"])  # the matrix angle is counter-clockwise
            break
    if angle is None:
        try:
            angle = float((stream.get("tags") or {}).get("rotate") or 0)
        except ValueError:
            angle = 0.0
    return int(round(angle or 0)) % 360


def _count_frames(path: Path, timeout_s: float, tools: MediaTools) -> Optional[int]:
    """Count video packets (no decoding) when the container does not store nb_frames (mkv, webm)."""
    out = run(
        [
            tools.ffprobe,
            "-v",
            "error",
            "-select_streams",
            "v:0",
            "-count_packets",
            "-show_entries",
            "stream=nb_read_packets",
            "-of",
            "json",
            str(path),
        ],
        timeout_s=timeout_s,
        what=f"counting frames of {path}",
    )
    streams = json.loads(out or b"{}").get("streams") or []
    return (
        int(streams[0]["nb_read_packets"]) if streams and str(streams[0].get("nb_read_packets", "")).isdigit() else None
    )


def probe(
    path: PathLike, *, timeout_s: float = PROBE_TIMEOUT_S, tools: MediaTools = ON_PATH, count_packets: bool = False
) -> MediaInfo:
    """Describe a media file; MediaError("… cannot be read as media") for anything ffprobe cannot parse.
    `count_packets`: the frame count is always the video's packets (demuxed, not decoded), never the header's
    nb_frames, which can say anything (what an upload's limits are checked on)."""
    path = Path(path)
    if not path.is_file():
        raise MediaError(f"{path} does not exist")
    try:
        out = run(
            [tools.ffprobe, "-v", "error", "-print_format", "json", "-show_format", "-show_streams", str(path)],
            timeout_s=timeout_s,
            what=f"probing {path}",
        )
        data = json.loads(out or b"{}")
    except (MediaError, ValueError) as exc:
        raise MediaError(f"{path.name} cannot be read as media: {exc}") from exc
    streams = data.get("streams") or []
    video = next(
        (s for s in streams if s.get("codec_type") == "video" and not (s.get("disposition") or {}).get("attached_pic")),
        None,
    )  # cover art is no video
    audio = next((s for s in streams if s.get("codec_type") == "audio"), None)
    if video is None and audio is None:
        raise MediaError(f"{path.name} cannot be read as media: no audio or video stream")
    fmt = data.get("format") or {}
    video_duration = _stream_duration(video)
    audio_duration = _stream_duration(audio)
    duration = _float(fmt.get("duration")) or max(video_duration or 0.0, audio_duration or 0.0)
    info: dict[str, Any] = {}
    if video is not None:
        rotation = _rotation(video)
        width, height = int(video.get("width") or 0), int(video.get("height") or 0)
        if rotation in (90, 270):
            width, height = height, width
        fps = _ratio(video.get("avg_frame_rate"))
        frames = int(video["nb_frames"]) if str(video.get("nb_frames", "")).isdigit() and not count_packets else None
        if not frames:
            frames = _count_frames(path, timeout_s, tools)
        if not frames and fps and not count_packets:
            frames = int(round((video_duration or duration) * fps))
        info.update(
            width=width,
            height=height,
            fps=fps,
            frame_count=frames or 0,
            video_codec=video.get("codec_name"),
            rotation=rotation,
            fps_exact=video.get("avg_frame_rate") if fps else None,
        )
    if audio is not None:
        info.update(
            audio_codec=audio.get("codec_name"),
            audio_sample_rate=int(audio["sample_rate"]) if audio.get("sample_rate") else None,
            audio_channels=audio.get("channels"),
        )
    return MediaInfo(
        duration_s=duration,
        has_video=video is not None,
        has_audio=audio is not None,
        audio_duration_s=audio_duration if audio is not None else None,
        video_duration_s=video_duration if video is not None else None,
        **info,
    )


MEASURE_RATE = 8000  # Hz: audio is decoded at this rate, mono 16-bit, only to count its samples


def measured_audio_s(
    path: PathLike, *, limit_s: float, timeout_s: float = PROBE_TIMEOUT_S, tools: MediaTools = ON_PATH
) -> float:
    """Seconds the first audio stream really decodes to, counted in samples rather than read from a header (which
    can say 5 s over two hours of audio, or timestamps that stand still); decoding stops one second past
    `limit_s`, so a longer stream costs no more than that to refuse."""
    path = Path(path)
    samples = run(
        [
            tools.ffmpeg,
            *BASE_ARGS,
            "-i",
            str(path),
            "-map",
            "0:a:0",
            "-vn",
            "-sn",
            "-dn",
            "-af",
            "asetpts=N/SR/TB",
            "-t",
            f"{limit_s + 1:.3f}",
            "-ac",
            "1",
            "-ar",
            str(MEASURE_RATE),
            "-f",
            "s16le",
            "pipe:1",
        ],
        timeout_s=timeout_s,
        what=f"measuring the audio of {path.name}",
    )
    return len(samples) / (2 * MEASURE_RATE)
