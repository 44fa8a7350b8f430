"""Output frame rate vs the source's: which source frame each output frame shows, and which rate a job gets."""

from __future__ import annotations

import numpy as np
import pytest

from app.pipeline.control import StageControl
from app.pipeline.lipsync.faces import crop_box, detect_faces, fill_missing
from app.pipeline.lipsync.frames import pingpong_index, shows_a_frame_twice, source_frame
from app.pipeline.lipsync.inference import audio_features, run_lipsync
from app.pipeline.lipsync.musetalk import load_musetalk
from app.http.uploads import output_fps
from harness.models import tiny_musetalk_profile
from harness.media import astronaut_frames, write_wav

MARGIN = 10


def _mapping(num_frames: int, n: int, source_fps: float | None, out_fps: float | None) -> list[int]:
    return [source_frame(i, n, source_fps, out_fps) for i in range(num_frames)]


@pytest.mark.parametrize("fps", [25.0, 30.0, 30000 / 1001, 24000 / 1001, 60.0, 7.5])
def test_equal_rates_are_the_one_for_one_pingpong_mapping(fps):
    n = 37
    expected = [pingpong_index(i, n) for i in range(500)]
    assert _mapping(500, n, fps, fps) == expected
    assert _mapping(500, n, None, None) == expected == _mapping(500, n, None, fps)


def test_30_fps_source_at_25_fps_spans_the_same_source_time():
    """2 s of output at 25 fps walks 2 s of a 30 fps source: six source frames per five output frames."""
    n, out = 300, 50  # a 10 s source, so nothing cycles
    shown = _mapping(out, n, 30.0, 25.0)
    assert shown[:6] == [0, 1, 2, 3, 4, 6]  # floor(i * 1.2)
    steps = np.diff(shown)
    assert set(steps) == {1, 2} and list(steps).count(2) == (out - 1) // 5
    for i, s in enumerate(shown):  # the source frame on screen at the output frame's time
        assert s / 30 <= i / 25 < (s + 1) / 30
    assert shown[-1] == 58  # 1.93 s of source at output time 1.96 s
    assert source_frame(out, n, 30.0, 25.0) == 60  # the next frame would start at 2 s of both: same span


def test_24_fps_source_at_30_fps_repeats_frames_and_skips_none():
    n, out = 100, 120  # 4 s of output over a 4.17 s source
    shown = _mapping(out, n, 24.0, 30.0)
    steps = np.diff(shown)
    assert set(steps) == {0, 1}  # never skips a source frame
    assert shown[-1] == 95 and sorted(set(shown)) == list(range(96))  # 4 s of source, every frame shown
    assert out - len(set(shown)) == 24  # one repeat per 5 output frames
    assert shows_a_frame_twice(out, n, 24.0, 30.0)


def test_resampled_positions_ping_pong_past_the_last_source_frame():
    """Audio longer than the video: positions past the end come back, as one for one does."""
    n = 10
    shown = _mapping(40, n, 30.0, 25.0)  # positions 0..46
    assert shown == [pingpong_index(int(i * 1.2 + 1e-6), n) for i in range(40)]
    assert max(shown) == n - 1 and min(shown[9:]) >= 0 and shown[20] == pingpong_index(24, n) == 4


def test_29_97_at_29_97_never_floors_a_frame_short():
    fps = 30000 / 1001
    assert all(source_frame(i, 10**6, fps, fps) == i for i in range(0, 72_000, 7))


def test_shows_a_frame_twice_decides_when_source_latents_are_kept():
    assert not shows_a_frame_twice(50, 75)  # one for one, no cycle
    assert shows_a_frame_twice(76, 75)  # one for one, cycling
    assert not shows_a_frame_twice(50, 75, 25.0, 25.0)
    assert not shows_a_frame_twice(50, 75, 30.0, 25.0)  # faster source: frames skipped, none twice
    assert shows_a_frame_twice(70, 75, 30.0, 25.0)  # positions reach 82: cycling back
    assert shows_a_frame_twice(10, 75, 24.0, 30.0)  # slower source: repeats without cycling
    with pytest.raises(ValueError, match="frame rates"):
        source_frame(3, 10, 30.0, None)


@pytest.mark.parametrize(
    "requested, source, expected",
    [
        (None, 30.0, (30.0, "source")),
        (0.0, 30.0, (30.0, "source")),
        (25.0, 30.0, (25.0, "request")),
        (None, None, (25.0, "default")),
        (None, 240.0, (25.0, "default")),
        (0.0, 120.0, (120.0, "source")),
        (12.5, None, (12.5, "request")),
    ],
)
def test_output_fps_rule(requested, source, expected):
    assert output_fps(requested, source, 25.0) == expected


# -- run_lipsync resamples the real frames ------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_musetalk(tiny_musetalk_profile(tmp_path_factory), "cpu")


@pytest.fixture(scope="module")
def clip():
    frames = astronaut_frames(6)
    return frames, fill_missing(detect_faces(frames))


@pytest.mark.parametrize("source_fps, out_fps, num_frames", [(30.0, 25.0, 9), (24.0, 30.0, 7)])
def test_run_lipsync_shows_the_resampled_source_frames(models, clip, tmp_path, source_fps, out_fps, num_frames):
    """Outside its face box every output frame is exactly the source frame `source_frame` names."""
    frames, boxes = clip
    features = audio_features(
        models, write_wav(tmp_path / "a.wav", 0.4), fps=out_fps, num_frames=num_frames, padding_left=2, padding_right=2
    )
    out: list[np.ndarray] = []
    run_lipsync(
        models,
        frames,
        boxes,
        features,
        num_frames=num_frames,
        batch_size=4,
        extra_margin=MARGIN,
        sink=out.append,
        control=StageControl(),
        fps=out_fps,
        source_fps=source_fps,
    )
    assert len(out) == num_frames
    shown = _mapping(num_frames, len(frames), source_fps, out_fps)
    for i, (frame, s) in enumerate(zip(out, shown, strict=True)):
        x1, y1, x2, y2 = crop_box(boxes[s], frames[s].shape, MARGIN)
        outside = np.ones(frames[s].shape[:2], bool)
        outside[y1:y2, x1:x2] = False
        assert np.array_equal(frame[outside], frames[s][outside]), f"output {i} is not source frame {s}"
        others = [t for t in range(len(frames)) if t != s]
        assert not any(np.array_equal(frame[outside], frames[t][outside]) for t in others)


def test_a_source_frame_shown_twice_is_encoded_once(models, clip, tmp_path):
    """24 -> 30 fps without cycling shows frames twice: run_lipsync keeps their latents (5 crops through the
    VAE encoder for 7 output frames), as it does when the output cycles."""
    frames, boxes = clip
    assert _mapping(7, len(frames), 24.0, 30.0) == [0, 0, 1, 2, 3, 4, 4]
    features = audio_features(
        models, write_wav(tmp_path / "a.wav", 0.3), fps=30.0, num_frames=7, padding_left=2, padding_right=2
    )
    crops_encoded = []
    encode = models.vae.encode
    models.vae.encode = lambda images, **kw: (crops_encoded.append(images.shape[0] // 2), encode(images, **kw))[1]
    try:
        run_lipsync(
            models,
            frames,
            boxes,
            features,
            num_frames=7,
            batch_size=3,
            extra_margin=MARGIN,
            sink=lambda frame: None,
            control=StageControl(),
            fps=30.0,
            source_fps=24.0,
        )
    finally:
        del models.vae.encode
    assert sum(crops_encoded) == 5
