"""Face boxes from the Haar cascade that ships in opencv-python-headless (the fallback detector), on a real face photo."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from skimage import data

from app.pipeline.control import StageControl
from app.pipeline.lipsync.faces import NoFaceDetected, crop_box, detect_face, detect_faces, fill_missing
from harness.media import astronaut_frames

ASTRONAUT_FACE = (177, 66, 272, 161)  # the face in skimage.data.astronaut() (512x512), by inspection


def expected_face(i: int, size: tuple[int, int] = (320, 240)) -> tuple[float, float, float, float]:
    scale = size[1] / 512
    x1, y1, x2, y2 = (v * scale for v in ASTRONAUT_FACE)
    shift = 20 + 3 * i
    return x1 + shift, y1, x2 + shift, y2


def iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def test_astronaut_face_is_found_in_the_photo():
    box = detect_face(data.astronaut())
    assert box is not None and iou(box, ASTRONAUT_FACE) > 0.6
    assert all(isinstance(v, int) for v in box)


def test_face_is_found_in_every_frame_of_a_small_clip_and_follows_it():
    frames = astronaut_frames(6)
    boxes = detect_faces(frames)
    for i, box in enumerate(boxes):
        assert box is not None, f"frame {i}"
        assert iou(box, expected_face(i)) > 0.5, (i, box, expected_face(i))
    assert boxes[-1][0] > boxes[0][0]  # the face moved right


def test_large_frames_are_detected_at_full_resolution_coordinates():
    big = cv2.resize(data.astronaut(), (1280, 1280))
    box = detect_face(big)
    assert box is not None and iou(box, [v * 2.5 for v in ASTRONAUT_FACE]) > 0.6


def test_the_largest_face_wins():
    portrait = data.astronaut()
    frame = np.full((260, 480, 3), 128, np.uint8)
    frame[:160, :160] = cv2.resize(portrait, (160, 160))
    frame[20:260, 230:470] = cv2.resize(portrait, (240, 240))
    box = detect_face(frame)
    assert box is not None and box[0] > 230 and box[2] - box[0] > 40


def test_blank_clip_raises_no_face_detected():
    blank = [np.full((240, 320, 3), 40, np.uint8) for _ in range(4)]
    boxes = detect_faces(blank)
    assert boxes == [None] * 4
    with pytest.raises(NoFaceDetected, match="no face detected") as caught:
        fill_missing(boxes)
    assert isinstance(caught.value, ValueError)
    with pytest.raises(NoFaceDetected):
        fill_missing([])


def test_frames_without_a_face_take_the_nearest_box():
    face = astronaut_frames(6)
    blank = np.full_like(face[0], 40)
    frames = [blank, face[1], blank, blank, blank, face[5], blank]
    detected = detect_faces(frames)
    assert [b is not None for b in detected] == [False, True, False, False, False, True, False]
    filled = fill_missing(detected)
    a, b = detected[1], detected[5]
    assert a != b
    # frame 3 is as far from 1 as from 5: the earlier box wins the tie
    assert filled == [a, a, a, a, b, b, b]
    assert len(filled) == len(frames)


def test_stride_examines_every_nth_frame_and_reports_progress():
    reports: list[tuple[float, str]] = []
    frames = astronaut_frames(5)
    boxes = detect_faces(frames, stride=2, control=StageControl(report=lambda f, d: reports.append((f, d))))
    assert [b is not None for b in boxes] == [True, False, True, False, True]
    assert reports[-1] == (1.0, "3/3 frames")
    assert len(fill_missing(boxes)) == 5
    with pytest.raises(ValueError):
        detect_faces(frames, stride=0)


def test_crop_box_adds_the_margin_below_and_clips_to_the_frame():
    assert crop_box((100, 30, 150, 80), (240, 320, 3), 10) == (100, 30, 150, 90)
    assert crop_box((100, 180, 150, 235), (240, 320, 3), 10) == (100, 180, 150, 240)  # clipped at the bottom
    assert crop_box((-5, -3, 330, 200), (240, 320, 3), 0) == (0, 0, 320, 200)  # and at the sides
    with pytest.raises(ValueError):
        crop_box((300, 10, 290, 50), (240, 320, 3), 10)
