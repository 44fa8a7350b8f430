"""Test media: clips for the lip-sync tests built with real ffmpeg from a real face photograph, frames of it
drifting across a frame, and a voice-like sweep as a WAV file."""

from __future__ import annotations

import re
import struct
import subprocess
import wave
from pathlib import Path

import numpy as np
import skimage.data

from app.pipeline.media import samples


def face_image(size: int = 256) -> np.ndarray:
    import cv2

    return cv2.resize(skimage.data.astronaut(), (size, size), interpolation=cv2.INTER_AREA)


def face_video(path: Path, seconds: float, fps: float = 25, audio: Path | None = None, size: int = 256) -> Path:
    return samples.make_face_video(path, face_image(size), seconds, fps, audio=audio)


def blank_video(path: Path, seconds: float, fps: float = 25, size: int = 256) -> Path:
    """A video with no face anywhere: a mid-grey picture (not black, so black output is detectable)."""
    return samples.make_face_video(path, np.full((size, size, 3), 128, np.uint8), seconds, fps, motion=False)


def tone(path: Path, seconds: float, freq: float = 330.0) -> Path:
    return samples.make_test_tone(path, seconds, freq)


def upload(client, video: Path, audio: Path, **fields):
    """POST /api/v1/lipsync with both files as multipart uploads."""
    data = {k: str(v) for k, v in fields.items()}
    with open(video, "rb") as v, open(audio, "rb") as a:
        data["video"] = (v, video.name)
        data["audio"] = (a, audio.name)
        return client.post("/api/v1/lipsync", data=data, content_type="multipart/form-data")


def astronaut_frames(count: int, size: tuple[int, int] = (320, 240)) -> list[np.ndarray]:
    """A short clip: the astronaut scaled to the frame height, drifting right 3 px a frame over a grey
    background whose level differs per frame (so every frame's pixels outside the face differ)."""
    import cv2

    width, height = size
    portrait = cv2.resize(skimage.data.astronaut(), (height, height), interpolation=cv2.INTER_AREA)
    frames = []
    for i in range(count):
        frame = np.full((height, width, 3), 90 + 7 * i, np.uint8)
        frame[:, 20 + 3 * i : 20 + 3 * i + height] = portrait
        frames.append(frame)
    return frames


def write_wav(path: Path, seconds: float, rate: int = 16000) -> Path:
    """A mono 16-bit sweep with a little noise (seeded): speech-like enough for the audio encoder."""
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * rate)) / rate
    signal = 0.3 * np.sin(2 * np.pi * (200 + 100 * t) * t) + 0.05 * rng.standard_normal(t.size)
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes((signal * 32767).astype(np.int16).tobytes())
    return path


def matroska_that_says(source: Path, path: Path, seconds: float) -> Path:
    """`source` remuxed to Matroska with a header that lies: the segment's duration and every track's DURATION
    tag say `seconds`, whatever the streams hold (what a hostile upload sends to pass a length limit)."""
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-i", str(source), "-c", "copy", str(path)], check=True, timeout=120)
    data = bytearray(path.read_bytes())
    at = data.find(b"\x44\x89\x88")  # Segment Info / Duration, an 8-byte float in TimestampScale units (1 ms)
    assert at >= 0, "no segment duration written"
    data[at + 3 : at + 11] = struct.pack(">d", seconds * 1000.0)
    hours, rest = divmod(seconds, 3600)
    claimed = f"{int(hours):02d}:{int(rest // 60):02d}:{rest % 60:012.9f}".encode()
    for tag in re.finditer(rb"\d\d:\d\d:\d\d\.\d{9}", bytes(data)):
        data[tag.start() : tag.end()] = claimed
    path.write_bytes(bytes(data))
    return path
