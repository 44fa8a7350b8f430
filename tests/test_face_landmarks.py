"""Faces the way MuseTalk finds them (issue 12): 68 landmarks from dlib's shape predictor (shipped by
face-recognition-models) on dlib's HOG detector, MuseTalk's landmark box, the jaw blend mask, smoothing over
time, shot cuts, and the Haar fallback. Real photographs: scikit-image's astronaut and matplotlib's Grace
Hopper portrait (both ship inside their wheels)."""

from __future__ import annotations

from pathlib import Path

import cv2
import matplotlib
import numpy as np
import pytest
from skimage import data

from app.pipeline.control import StageControl
from app.pipeline.lipsync import faces
from app.pipeline.lipsync.faces import FaceTrack, NoFaceDetected, crop_box, find_faces, landmark_box
from app.pipeline.lipsync.inference import jaw_mask, mouth_mask

CHIN, NOSE_TIP, UPPER_LIP_INNER, LOWER_LIP_INNER = 8, 30, 62, 66
MOUTH = list(range(48, 68))


def hopper() -> np.ndarray:
    path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    return cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB)


PHOTOS = {"astronaut": data.astronaut, "grace_hopper": hopper}


def shifted(image: np.ndarray, dx: int, dy: int, pad: int = 16) -> np.ndarray:
    """The photo moved by (dx, dy) inside a grey border of `pad` px (so every shift stays in the frame)."""
    height, width = image.shape[:2]
    frame = np.full((height + 2 * pad, width + 2 * pad, 3), 128, np.uint8)
    frame[pad + dy : pad + dy + height, pad + dx : pad + dx + width] = image
    return frame


def weight(mask: np.ndarray, region, point) -> float:
    x, y = int(round(point[0])) - region[0], int(round(point[1])) - region[1]
    return float(mask[y, x, 0])


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_the_landmark_box_is_musetalks_and_holds_the_chin_and_the_mouth(name):
    image = PHOTOS[name]()
    track = find_faces([image])
    assert track.method == "landmarks" and track.frames_with_face == 1
    points, box = track.landmarks[0], track.boxes[0]
    x1, y1, x2, y2 = box
    assert (x1, x2, y2) == (int(points[:, 0].min()), int(points[:, 0].max()), int(points[:, 1].max()))
    assert y1 == int(points[29, 1]) - (y2 - int(points[29, 1]))  # the nose bridge halves the box
    assert y2 - 1 <= points[CHIN, 1] <= y2  # the chin is the lowest landmark
    for x, y in points[MOUTH]:
        assert x1 <= x <= x2 and (y1 + y2) / 2 < y < y2  # the mouth lies in the box's lower half
    assert (x2 - x1) > 0.1 * image.shape[1]  # a face, not a speck


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_the_jaw_mask_takes_the_mouth_and_leaves_the_nose_and_the_neck(name):
    image = PHOTOS[name]()
    track = find_faces([image])
    points = track.landmarks[0]
    region = crop_box(track.boxes[0], image.shape, 30)  # room below the chin to look at
    mask = jaw_mask(points, region)
    assert mask.shape == (region[3] - region[1], region[2] - region[0], 1)
    assert weight(mask, region, (points[UPPER_LIP_INNER] + points[LOWER_LIP_INNER]) / 2) > 0.95
    assert weight(mask, region, points[NOSE_TIP]) < 0.05
    blur = 0.05 * 1.5 * max(region[2] - region[0], region[3] - region[1])  # the kernel's width
    below_chin = (points[CHIN, 0], points[CHIN, 1] + blur / 2 + 4)  # past the blur's reach
    assert weight(mask, region, below_chin) < 0.1
    assert float(mask[-3:].max()) < 0.05  # the neck at the bottom of the box stays the source's
    assert float(mask[: mask.shape[0] // 2 - 3].max()) < 0.2  # cut at the centre row (blur aside)
    assert float(mask[:, 0].max()) < 0.2 and float(mask[:, -1].max()) < 0.2  # cheeks eroded, not the box's edge
    rectangle = mouth_mask(*mask.shape[:2])
    assert 0.2 < float(mask.sum()) / float(rectangle.sum()) < 1.0  # a shaped region inside the rectangle


def test_smoothing_bounds_the_box_jitter_of_a_shaking_still_photo():
    rng = np.random.default_rng(12)
    shifts = [(int(rng.integers(-3, 4)), int(rng.integers(-3, 4))) for _ in range(20)]
    photo = cv2.resize(data.astronaut(), (384, 384), interpolation=cv2.INTER_AREA)
    frames = [shifted(photo, dx, dy) for dx, dy in shifts]
    track = find_faces(frames)
    assert track.cuts == [0] and track.frames_with_face == len(frames)
    raw = [landmark_box(faces._fit_landmarks(f, r)) for f, r in ((f, faces._detect_rect(f)) for f in frames)]

    def jitter(boxes):  # spread of the box's size and of its position once the known shift is taken out
        sizes = np.array([(b[2] - b[0], b[3] - b[1]) for b in boxes], float)
        origin = np.array([(b[0] - dx, b[1] - dy) for b, (dx, dy) in zip(boxes, shifts, strict=True)], float)
        return float(np.abs(np.diff(sizes, axis=0)).max()), float(np.abs(np.diff(origin, axis=0)).max())

    size_raw, _ = jitter(raw)
    size_smooth, _ = jitter(track.boxes)
    assert size_smooth <= max(2.0, 0.6 * size_raw), (size_smooth, size_raw)
    assert max(abs(b[0] - r[0]) for b, r in zip(track.boxes, raw, strict=True)) <= 6  # still the same face


def test_a_shot_cut_restarts_the_smoothing_and_a_faceless_frame_takes_its_neighbours_face():
    astronaut = cv2.resize(data.astronaut(), (400, 400))
    portrait = cv2.resize(hopper(), (400, 468))[:400]
    blank = np.full_like(astronaut, 128)
    frames = [astronaut] * 4 + [portrait, portrait, blank, portrait]
    track = find_faces(frames)
    assert track.cuts == [0, 4, 6, 7]  # the blank frame is a shot of its own too
    alone = find_faces([portrait])
    assert track.boxes[4] == alone.boxes[0]  # nothing of the first shot leaks into the second
    assert track.boxes[0] == find_faces([astronaut]).boxes[0]
    assert track.frames_with_face == 7
    assert track.boxes[6] in (track.boxes[5], track.boxes[7])  # the faceless frame reuses a neighbour's face


def test_without_landmarks_the_haar_fallback_gives_boxes_and_no_landmarks(monkeypatch):
    """dlib missing (simulated: the only way to exercise this on a machine that has it)."""
    monkeypatch.setattr(faces, "landmarks_available", lambda: False)
    track = find_faces([data.astronaut()] * 2)
    assert track.method == "haar" and track.landmarks is None and len(track.boxes) == 2
    assert FaceTrack.from_json(track.to_json()) == track


def test_a_clip_without_a_face_is_no_face_detected_and_progress_is_reported():
    reports: list[str] = []
    blank = [np.full((240, 320, 3), 40 + i, np.uint8) for i in range(3)]
    with pytest.raises(NoFaceDetected):
        find_faces(blank, control=StageControl(report=lambda f, d: reports.append(d)))
    assert reports and reports[-1] == "3/3 frames"


def test_a_track_survives_its_json_round_trip():
    track = find_faces([data.astronaut()])
    again = FaceTrack.from_json(track.to_json())
    assert again.boxes == track.boxes and again.method == "landmarks"
    assert np.allclose(again.landmarks[0], track.landmarks[0], atol=0.01)


def test_the_mask_mode_is_a_setting_and_only_jaw_or_rectangle(monkeypatch):
    from app.core.config import Settings

    assert Settings().lipsync_mask == "jaw"
    monkeypatch.setenv("ENCORE_LIPSYNC_MASK", "rectangle")
    assert Settings().lipsync_mask == "rectangle"
    monkeypatch.setenv("ENCORE_LIPSYNC_MASK", "oval")
    with pytest.raises(ValueError, match="ENCORE_LIPSYNC_MASK must be jaw or rectangle"):
        Settings()


@pytest.mark.slow  # dlib on several threads (~6-12 s here)
def test_threads_share_the_face_work_with_the_same_result_as_one():
    """Pieces of faces.SEGMENT frames start on a detection frame, so tracking them on several threads gives
    exactly one thread's landmarks, boxes and cuts (here 3 pieces, a shot cut inside the second, and frames
    without a face at the start of the third)."""
    rng = np.random.default_rng(5)
    photo = cv2.resize(data.astronaut(), (256, 256), interpolation=cv2.INTER_AREA)
    other = cv2.resize(hopper(), (256, 256), interpolation=cv2.INTER_AREA)
    count = 2 * faces.SEGMENT + 30
    frames = []
    for i in range(count):
        dx, dy = int(rng.integers(-4, 5)), int(rng.integers(-4, 5))
        frames.append(shifted(other if i >= 150 else photo, dx, dy))
    for i in range(2 * faces.SEGMENT, 2 * faces.SEGMENT + 7):
        frames[i] = np.full_like(frames[0], 90)
    one, three = find_faces(frames, threads=1), find_faces(frames, threads=3)
    assert one.cuts == three.cuts and 150 in one.cuts
    assert one.boxes == three.boxes and one.frames_with_face == three.frames_with_face == count - 7
    assert all(np.array_equal(a, b) for a, b in zip(one.landmarks, three.landmarks, strict=True))
    haar_one = faces.detect_faces(frames[:40], stride=2, threads=1)
    assert faces.detect_faces(frames[:40], stride=2, threads=2) == haar_one
    with pytest.raises(ValueError):
        find_faces(frames[:2], threads=0)
