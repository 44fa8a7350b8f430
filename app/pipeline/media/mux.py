"""The final mux of a lip-sync job: picture from the model's output, sound only from the driving audio.

Never the source video's own audio track. The picture is stream-copied when it covers the audio and looped
and re-encoded only when it is shorter (it is never looped before inference: that multiplied the frames).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from app.pipeline.media.encode import AAC_BITRATE, h264_args, pick_h264_encoder
from app.pipeline.media.ffmpeg import BASE_ARGS, ON_PATH, MediaError, MediaTools, PathLike, run, temp_sibling
from app.pipeline.media.probe import effective_fps, probe


def mux_command(
    picture: PathLike,
    audio: PathLike,
    out: PathLike,
    *,
    audio_duration_s: float,
    loop: bool,
    encoder: str = "libx264",
    tools: MediaTools = ON_PATH,
) -> list[str]:
    """The ffmpeg command of the final mux. Picture only from input 0, sound only from input 1 (the driving
    audio) — never the source video's own track. Copy the picture when it covers the audio; loop and
    re-encode it only when it is shorter. Output is cut to the audio's duration."""
    duration = f"{audio_duration_s:.6f}"
    if loop:
        inputs = ["-stream_loop", "-1", "-i", str(picture), "-i", str(audio)]
        video = h264_args(encoder)
    else:
        inputs = ["-i", str(picture), "-i", str(audio)]
        video = ["-c:v", "copy"]
    return [
        tools.ffmpeg,
        *BASE_ARGS,
        *inputs,
        "-map",
        "0:v:0",
        "-map",
        "1:a:0",
        *video,
        "-c:a",
        "aac",
        "-b:a",
        AAC_BITRATE,
        "-t",
        duration,
        "-movflags",
        "+faststart",
        "-f",
        "mp4",
        str(out),
    ]


def mux(
    picture: PathLike,
    audio: PathLike,
    out: PathLike,
    *,
    audio_duration_s: Optional[float] = None,
    picture_duration_s: Optional[float] = None,
    timeout_s: float,
    encoder: Optional[str] = None,
    tools: MediaTools = ON_PATH,
) -> Path:
    """Final MP4 = lip-synced picture + driving audio, duration == audio duration (± one frame).

    The picture "covers" the audio when it is at most one frame shorter (the lip-sync stage emits
    floor(audio × fps) frames): then the video is stream-copied. Otherwise it is looped and re-encoded.
    Durations are probed when not given. Written atomically; MediaError on failure or timeout."""
    picture, audio, out = Path(picture), Path(audio), Path(out)
    info = probe(picture, tools=tools)
    if not info.has_video:
        raise MediaError(f"{picture.name} has no video stream to mux")
    if audio_duration_s is None:
        audio_info = probe(audio, tools=tools)
        audio_duration_s = audio_info.audio_duration_s or audio_info.duration_s
    if picture_duration_s is None:
        picture_duration_s = info.video_duration_s or info.duration_s
    if not audio_duration_s or audio_duration_s <= 0:
        raise MediaError(f"{audio.name}: audio duration unknown or zero")
    frame_s = 1.0 / effective_fps(info)
    loop = picture_duration_s + frame_s + 1e-6 < audio_duration_s
    argv = mux_command(
        picture,
        audio,
        temp_sibling(out),
        audio_duration_s=audio_duration_s,
        loop=loop,
        encoder=(encoder or pick_h264_encoder(tools=tools)) if loop else "libx264",
        tools=tools,
    )
    tmp = Path(argv[-1])
    try:
        run(argv, timeout_s=timeout_s, what=f"muxing {picture.name} + {audio.name}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
