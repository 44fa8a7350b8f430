"""Test clips for the lip-sync tests, built with real ffmpeg from a real face photograph."""
from __future__ import annotations

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
