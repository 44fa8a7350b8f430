"""Face boxes and landmarks for lip-sync, from detectors whose weights ship inside PyPI packages.

MuseTalk (musetalk/utils/preprocessing.py get_landmark_and_bbox) takes 68 face landmarks per frame (DWPose's
face keypoints, the iBUG 68-point layout) and a detected face box. Its crop box is landmark geometry:
x from the leftmost to the rightmost landmark (jaw to jaw), y2 at the lowest one (the chin), and
y1 = y(29) - (y2 - y(29)), landmark 29 being on the nose bridge, so the lower half of the box runs from the
nose to the chin; when that box is degenerate (or starts left of the frame) the detector's box is used.
MuseTalk v1.5 then adds `extra_margin` px below (scripts/inference.py), which `crop_box` applies.

Here the 68 points come from dlib's shape predictor (`shape_predictor_68_face_landmarks.dat`, shipped by the
`face-recognition-models` package; the same 68-point layout) on faces found by dlib's HOG frontal detector
(built into `dlib-bin`). Nothing is downloaded. The detector runs every DETECT_EVERY frames and after a shot
cut; in between, the last detected rectangle follows the landmarks' centroid. Landmarks are then smoothed
over time (`smooth`: a centred moving average over SMOOTH_RADIUS frames each side, restarted at every shot
cut) so the crop does not jitter. Frames without a face take the nearest frame's smoothed face.

Fallback: when dlib cannot be imported, or finds no face anywhere in the clip, OpenCV's Haar cascade
(`haarcascade_frontalface_default.xml`, in opencv-python-headless) gives boxes without landmarks, and the
blend falls back to the rectangle mask. A clip with no face at all is a clear `NoFaceDetected`.
"""

from __future__ import annotations

from itertools import pairwise
import importlib.util
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence, TypeVar

import cv2
import cv2.data  # the cascade files' folder (imported by cv2 at run time too; named so the types know it)
import numpy as np

from app.pipeline.control import StageControl
from app.pipeline.lipsync.frames import FrameSequence

Box = tuple[int, int, int, int]  # x1, y1, x2, y2 in pixels; x2/y2 exclusive
Found = TypeVar("Found")  # what a frame may lack: a box, or landmarks

CASCADE_FILE = "haarcascade_frontalface_default.xml"
DETECT_MAX_SIDE = 640  # detect on a downscaled copy: Haar cost grows with pixels, faces stay findable
SCALE_FACTOR = 1.1
MIN_NEIGHBORS = 5


LANDMARKS = 68
NOSE_BRIDGE = 29  # the landmark MuseTalk splits the face at
DETECT_EVERY = 5  # HOG detection period in frames (landmarks are fitted on every frame)
HOG_SIDE = 640  # HOG runs on a copy this large (about 60 ms a frame on one CPU core)
CUT_THRESHOLD = 40.0  # mean absolute difference of 32x32 grey thumbnails that marks a shot cut
SMOOTH_RADIUS = 2  # frames on each side in the moving average of landmarks
SEGMENT = 20 * DETECT_EVERY  # frames per piece of work handed to a thread; a multiple of DETECT_EVERY, so
# every piece starts on a detection and the result equals one thread's
FACE_PIPELINE_VERSION = 1  # part of the source cache's key: bump when the boxes or landmarks change


def default_threads() -> int:
    """Threads for face finding: dlib and OpenCV release the GIL, so they scale with cores (at most 8)."""
    return max(1, min(8, os.cpu_count() or 1))


def _in_order(pool: ThreadPoolExecutor, futures: list[Future], total: int, control: StageControl | None) -> list:
    """Each future's list, concatenated in order, reporting progress as pieces finish; on an error or a
    cancel the pieces not yet started are dropped."""
    out: list = []
    try:
        for future in futures:
            out.extend(future.result())
            if control is not None:
                control.step(len(out), total, "frames")
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    return out


_per_thread = threading.local()  # detectors that must not be shared between threads


class NoFaceDetected(ValueError):
    """No frame of the clip has a detectable face."""


def _cascade() -> cv2.CascadeClassifier:
    """This thread's Haar cascade (OpenCV's classifier objects are not meant to be shared between threads)."""
    cascade = getattr(_per_thread, "cascade", None)
    if cascade is None:
        path = cv2.data.haarcascades + CASCADE_FILE
        cascade = cv2.CascadeClassifier(path)
        if cascade.empty():
            raise RuntimeError(f"could not load the face cascade {path}")
        _per_thread.cascade = cascade
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
    confident = [tuple(int(v) for v in f) for f, n in zip(found, votes, strict=True) if n * 2 >= max(votes)]
    x, y, w, h = max(confident, key=lambda f: f[2] * f[3])
    x1, y1 = int(x / scale), int(y / scale)
    x2, y2 = min(width, round((x + w) / scale)), min(height, round((y + h) / scale))
    return x1, y1, x2, y2


def detect_faces(
    frames: FrameSequence, *, stride: int = 1, threads: int = 1, control: StageControl | None = None
) -> list[Box | None]:
    """One entry per frame: the largest face, or None when none was found or the frame was skipped.

    With `stride` > 1 only every stride-th frame is examined (faces move little between neighbours);
    `fill_missing` then gives the skipped frames their nearest examined box. `threads` examine frames at once.
    """
    if stride < 1:
        raise ValueError("stride must be >= 1")
    if threads < 1:
        raise ValueError("threads must be >= 1")
    boxes: list[Box | None] = [None] * len(frames)
    examined = list(range(0, len(frames), stride))
    pieces = [examined[i : i + SEGMENT] for i in range(0, len(examined), SEGMENT)]
    with ThreadPoolExecutor(threads, thread_name_prefix="haar") as pool:
        futures = [pool.submit(lambda piece: [detect_face(frames[i]) for i in piece], piece) for piece in pieces]
        found = _in_order(pool, futures, len(examined), control)
    for index, box in zip(examined, found, strict=True):
        boxes[index] = box
    return boxes


def fill_missing(boxes: Sequence[Found | None]) -> list[Found]:
    """Give every frame without a box (or landmarks) the one of the nearest frame that has one (the earlier
    one on ties)."""
    detected = [(i, box) for i, box in enumerate(boxes) if box is not None]
    if not detected:
        raise NoFaceDetected("no face detected")
    filled: list[Found] = []
    j = 0  # index into `detected` of the nearest detection; only moves forward as i grows
    for i in range(len(boxes)):
        while j + 1 < len(detected) and abs(detected[j + 1][0] - i) < abs(detected[j][0] - i):
            j += 1
        filled.append(detected[j][1])
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


# -- landmarks (dlib) -------------------------------------------------------------------------------------


def _predictor_path() -> Path | None:
    """The 68-point model inside the face-recognition-models package, found without importing it (its
    __init__ needs pkg_resources, which recent setuptools no longer ships)."""
    spec = importlib.util.find_spec("face_recognition_models")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / "shape_predictor_68_face_landmarks.dat"
    return path if path.is_file() else None


@lru_cache(maxsize=1)
def _shape_predictor() -> Any | None:
    """dlib's 68-point shape predictor (shared: fitting is read-only), or None when dlib or the model file
    is missing."""
    try:
        import dlib
    except ImportError:
        return None
    path = _predictor_path()
    return None if path is None else dlib.shape_predictor(str(path))


def _hog_detector() -> Any:
    """This thread's HOG detector: one detector run from two threads at once gives wrong boxes (it keeps
    its image pyramid in the object), so each thread has its own (building one is cheap)."""
    if getattr(_per_thread, "detector", None) is None:
        import dlib

        _per_thread.detector = dlib.get_frontal_face_detector()
    return _per_thread.detector


def landmarks_available() -> bool:
    return _shape_predictor() is not None


def _detect_rect(frame: np.ndarray) -> Box | None:
    """The highest-scoring HOG face in an RGB frame (full-resolution pixels), or None."""
    detector = _hog_detector()
    height, width = frame.shape[:2]
    scale = HOG_SIDE / max(height, width)  # small frames are enlarged: HOG's window is 80 px
    image = cv2.resize(
        np.ascontiguousarray(frame),
        (round(width * scale), round(height * scale)),
        interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR,
    )
    rects, scores, _ = detector.run(image, 0, 0.0)
    if len(rects) == 0:  # a face smaller than the window at this size: look again at twice the size
        rects, scores, _ = detector.run(image, 1, 0.0)
    if len(rects) == 0:
        return None
    best = max(range(len(rects)), key=lambda i: scores[i])
    r = rects[best]
    return (round(r.left() / scale), round(r.top() / scale), round(r.right() / scale), round(r.bottom() / scale))


def _fit_landmarks(frame: np.ndarray, rect: Box) -> np.ndarray:
    """[68, 2] float landmarks inside `rect`."""
    import dlib

    predictor = _shape_predictor()
    if predictor is None:  # callers ask landmarks_available() first
        raise RuntimeError("dlib's 68-point shape predictor is not available")
    shape = predictor(np.ascontiguousarray(frame), dlib.rectangle(*(int(v) for v in rect)))
    return np.array([(p.x, p.y) for p in shape.parts()], dtype=np.float64)


def landmark_box(landmarks: np.ndarray) -> Box:
    """MuseTalk's crop box from 68 landmarks (integer pixels, as its int32 landmarks give)."""
    points = landmarks.astype(np.int32)
    x1, x2 = int(points[:, 0].min()), int(points[:, 0].max())
    y2 = int(points[:, 1].max())
    y1 = max(0, int(points[NOSE_BRIDGE, 1]) - (y2 - int(points[NOSE_BRIDGE, 1])))
    return x1, y1, x2, y2


def _thumbnail(frame: np.ndarray) -> np.ndarray:
    grey = cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2GRAY)
    return cv2.resize(grey, (32, 32), interpolation=cv2.INTER_AREA).astype(np.float32)


def shot_cuts(frames: FrameSequence, *, threads: int = 1) -> list[int]:
    """Indices of frames that start a new shot (0 always does)."""
    with ThreadPoolExecutor(threads, thread_name_prefix="cuts") as pool:
        thumbs = list(pool.map(lambda index: _thumbnail(frames[index]), range(len(frames))))
    return [0] + [
        index
        for index in range(1, len(thumbs))
        if float(np.abs(thumbs[index] - thumbs[index - 1]).mean()) > CUT_THRESHOLD
    ]


def _track_piece(frames: FrameSequence, starts: set[int], first: int, stop: int) -> list[tuple[np.ndarray, Box] | None]:
    """track_landmarks over frames [first, stop); `first` must be a detection frame (a multiple of
    DETECT_EVERY), which makes pieces independent."""
    found: list[tuple[np.ndarray, Box] | None] = []
    rect: Box | None = None
    anchor: np.ndarray | None = None  # landmark centroid when `rect` was detected
    for index in range(first, stop):
        frame = frames[index]
        if index in starts or index % DETECT_EVERY == 0:
            rect, anchor = _detect_rect(frame), None
        if rect is None:
            found.append(None)
            continue
        if anchor is not None and found[-1] is not None:  # follow the face since the detection
            dx, dy = found[-1][0].mean(axis=0) - anchor
            tracked = (round(rect[0] + dx), round(rect[1] + dy), round(rect[2] + dx), round(rect[3] + dy))
        else:
            tracked = rect
        landmarks = _fit_landmarks(frame, tracked)
        if anchor is None:
            anchor = landmarks.mean(axis=0)
        found.append((landmarks, tracked))
    return found


def track_landmarks(
    frames: FrameSequence, cuts: Sequence[int], *, threads: int = 1, control: StageControl | None = None
) -> list[tuple[np.ndarray, Box] | None]:
    """Per frame, (landmarks [68, 2], detector rectangle) or None where no face was found: a detection every
    DETECT_EVERY frames and at every cut, the rectangle following the landmarks in between. Pieces of
    SEGMENT frames run on `threads` threads with the same result as one."""
    starts, count = set(cuts), len(frames)
    bounds = [(first, min(first + SEGMENT, count)) for first in range(0, count, SEGMENT)]
    with ThreadPoolExecutor(threads, thread_name_prefix="landmarks") as pool:
        futures = [pool.submit(_track_piece, frames, starts, first, stop) for first, stop in bounds]
        return _in_order(pool, futures, count, control)


def smooth(
    values: list[np.ndarray | None], cuts: Sequence[int], radius: int = SMOOTH_RADIUS
) -> list[np.ndarray | None]:
    """Centred moving average of per-frame arrays over the frames that have one, within each shot."""
    bounds = list(cuts) + [len(values)]
    out: list[np.ndarray | None] = list(values)
    for start, stop in pairwise(bounds):
        present = [(i, value) for i, value in enumerate(values[start:stop], start) if value is not None]
        for k, (i, _) in enumerate(present):
            window = present[max(0, k - radius) : k + radius + 1]
            out[i] = np.mean([value for _, value in window], axis=0)
    return out


@dataclass(frozen=True)
class FaceTrack:
    """One face per source frame (gaps filled): crop boxes, landmarks when they could be had, and how."""

    boxes: list[Box]
    landmarks: list[np.ndarray] | None  # [68, 2] per frame, in frame pixels; None for the Haar fallback
    method: str  # "landmarks" or "haar"
    frames_with_face: int
    cuts: list[int]

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "frames_with_face": self.frames_with_face,
            "cuts": self.cuts,
            "boxes": [list(box) for box in self.boxes],
            "landmarks": None if self.landmarks is None else [np.round(p, 2).tolist() for p in self.landmarks],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "FaceTrack":
        landmarks = data["landmarks"]
        return cls(
            [tuple(box) for box in data["boxes"]],
            None if landmarks is None else [np.asarray(p, dtype=np.float64) for p in landmarks],
            data["method"],
            data["frames_with_face"],
            data["cuts"],
        )


def find_faces(frames: FrameSequence, *, threads: int = 1, control: StageControl | None = None) -> FaceTrack:
    """Landmarks (smoothed, gaps filled) and MuseTalk's boxes for every frame; the Haar fallback without
    landmarks when dlib is missing or finds nothing; NoFaceDetected when no frame has a face. `threads`
    share the per-frame work (the result does not depend on how many)."""
    if threads < 1:
        raise ValueError("threads must be >= 1")
    cuts = shot_cuts(frames, threads=threads)
    if landmarks_available():
        tracked = track_landmarks(frames, cuts, threads=threads, control=control)
        present = sum(t is not None for t in tracked)
        if present:
            points = fill_missing(smooth([t[0] if t else None for t in tracked], cuts))
            rects = fill_missing([t[1] if t else None for t in tracked])
            boxes = [_usable(landmark_box(p), rect, frames[0].shape) for p, rect in zip(points, rects, strict=True)]
            return FaceTrack(boxes, points, "landmarks", present, cuts)
    found = detect_faces(frames, threads=threads, control=control)
    boxes = fill_missing(found)
    return FaceTrack(boxes, None, "haar", sum(b is not None for b in found), cuts)


def _usable(box: Box, rect: Box, frame_shape: tuple[int, ...]) -> Box:
    """The landmark box, or (as MuseTalk does) the detector's box when the landmark box is degenerate."""
    x1, y1, x2, y2 = box
    if y2 - y1 <= 0 or x2 - x1 <= 0 or x1 < 0:
        height, width = frame_shape[:2]
        return max(0, rect[0]), max(0, rect[1]), min(width, rect[2]), min(height, rect[3])
    return box
