"""Face boxes for lip-sync, with a detector whose weights ship inside a PyPI package.

MuseTalk downloads S3FD and DWPose weights at run time; there is no network here, so this uses OpenCV's
Haar cascade `haarcascade_frontalface_default.xml` from `cv2.data` (part of opencv-python-headless).
Haar boxes run from the forehead to about the chin; MuseTalk v1.5 adds `extra_margin` pixels below the box
(scripts/inference.py: `y2 = min(y2 + extra_margin, frame height)`), which `crop_box` applies.

Frames without a face are never dropped (that misaligned frames and latents in MuseTalk and produced black
output): `fill_missing` gives them the nearest detected box, and a clip with no face at all is a clear
`NoFaceDetected` instead of MuseTalk's ZeroDivisionError.
"""
from __future__ import annotations

from functools import lru_cache

import cv2
import numpy as np

from app.pipeline.control import StageControl
from app.pipeline.lipsync.frames import FrameSequence

Box = tuple[int, int, int, int]  # x1, y1, x2, y2 in pixels; x2/y2 exclusive

CASCADE_FILE = "haarcascade_frontalface_default.xml"
DETECT_MAX_SIDE = 640   # detect on a downscaled copy: Haar cost grows with pixels, faces stay findable
SCALE_FACTOR = 1.1
MIN_NEIGHBORS = 5


class NoFaceDetected(ValueError):
    """No frame of the clip has a detectable face."""


@lru_cache(maxsize=1)
def _cascade() -> cv2.CascadeClassifier:
    path = cv2.data.haarcascades + CASCADE_FILE
    cascade = cv2.CascadeClassifier(path)
    if cascade.empty():
        raise RuntimeError(f"could not load the face cascade {path}")
    return cascade


def detect_face(frame: np.ndarray) -> Box | None:
    """Largest confidently detected face in one RGB frame, or None."""
    height, width = frame.shape[:2]
    scale = min(1.0, DETECT_MAX_SIDE / max(height, width))
    gray = cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2GRAY)
    if scale < 1.0:
        gray = cv2.resize(gray, (round(width * scale), round(height * scale)), interpolation=cv2.INTER_AREA)
    found, votes = _cascade().detectMultiScale2(gray, scaleFactor=SCALE_FACTOR, minNeighbors=MIN_NEIGHBORS)
    if len(found) == 0:
        return None
    # Haar false positives (collars, emblems) gather far fewer overlapping hits than a real face, and can
    # be bigger than it: pick the largest of the detections with at least half the best one's votes.
    confident = [tuple(int(v) for v in f) for f, n in zip(found, votes) if n * 2 >= max(votes)]
    x, y, w, h = max(confident, key=lambda f: f[2] * f[3])
    x1, y1 = int(x / scale), int(y / scale)
    x2, y2 = min(width, round((x + w) / scale)), min(height, round((y + h) / scale))
    return x1, y1, x2, y2


def detect_faces(frames: FrameSequence, *, stride: int = 1,
                 control: StageControl | None = None) -> list[Box | None]:
    """One entry per frame: the largest face, or None when none was found or the frame was skipped.

    With `stride` > 1 only every stride-th frame is examined (faces move little between neighbours);
    `fill_missing` then gives the skipped frames their nearest examined box.
    """
    if stride < 1:
        raise ValueError("stride must be >= 1")
    boxes: list[Box | None] = [None] * len(frames)
    examined = range(0, len(frames), stride)
    for done, index in enumerate(examined, start=1):
        boxes[index] = detect_face(frames[index])
        if control is not None:
            control.step(done, len(examined), "frames")
    return boxes


def fill_missing(boxes: list[Box | None]) -> list[Box]:
    """Give every frame without a box the box of the nearest frame that has one (the earlier one on ties)."""
    detected = [i for i, box in enumerate(boxes) if box is not None]
    if not detected:
        raise NoFaceDetected("no face detected")
    filled: list[Box] = []
    j = 0  # index into `detected` of the nearest detection; only moves forward as i grows
    for i in range(len(boxes)):
        while j + 1 < len(detected) and abs(detected[j + 1] - i) < abs(detected[j] - i):
            j += 1
        filled.append(boxes[detected[j]])
    return filled


def crop_box(box: Box, frame_shape: tuple[int, ...], extra_margin: int) -> Box:
    """MuseTalk v1.5's crop: the face box with `extra_margin` px added below (to take in the chin),
    clipped to the frame."""
    height, width = frame_shape[:2]
    x1, y1, x2, y2 = box
    x1, y1 = max(0, int(x1)), max(0, int(y1))
    x2, y2 = min(width, int(x2)), min(height, int(y2) + int(extra_margin))
    if x2 <= x1 or y2 <= y1:
        raise ValueError(f"face box {box} is empty inside a {width}x{height} frame")
    return x1, y1, x2, y2
