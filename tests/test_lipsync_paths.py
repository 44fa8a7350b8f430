"""Issue 13's fast lip-sync path against the reference, on the tiny random-weight models (their output is
noise; what is compared is that both paths compute the same thing):
- the device path (crops, resizes and the blend as tensor ops) against the reference path (OpenCV), frame
  by frame, within stated bounds, and exactly outside the face region;
- the audio prompts built per batch (AudioWindows) against window_features, and whisper's windows encoded
  in one batch against one at a time;
- the padded last batch against the unpadded one; read_ahead's order, errors and early close.
On a CPU the device path runs its tensor ops on the CPU; bench/gpu_lipsync.py checks the same bounds on CUDA.
"""

from __future__ import annotations

import threading

import cv2
import numpy as np
import pytest
import torch
from skimage import data

from app.pipeline.control import StageControl
from app.pipeline.lipsync import faces
from app.pipeline.lipsync.faces import crop_box
from app.pipeline.lipsync.inference import (
    WHISPER_WINDOWS_PER_PASS,
    AudioWindows,
    SourceLatents,
    device_crops,
    encode_pixels,
    face_crop,
    read_ahead,
    redraw_faces,
    run_lipsync,
    whisper_hidden_states,
    window_features,
)
from app.pipeline.lipsync.musetalk import WHISPER_SAMPLE_RATE, load_musetalk
from harness.models import tiny_musetalk_profile

MARGIN = 10
CROP_MEAN, CROP_MAX = 1.5, 40  # device crops vs OpenCV's Lanczos, in 8-bit levels


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_musetalk(tiny_musetalk_profile(tmp_path_factory), "cpu")


@pytest.fixture(scope="module")
def clip():
    """8 frames of a 640x400 scene with the astronaut's face moving, and its landmark track."""
    face = cv2.resize(data.astronaut(), (300, 300), interpolation=cv2.INTER_AREA)
    frames = []
    for i in range(8):
        frame = np.full((400, 640, 3), 70 + 3 * i, np.uint8)
        frame[40:340, 150 + 4 * i : 450 + 4 * i] = face
        frames.append(frame)
    return frames, faces.find_faces(frames)


def prompts(models, count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(count, 10 * models.audio_layers, models.audio_dim, generator=generator)


def test_device_crops_match_opencv_lanczos_within_bounds(clip):
    frames, track = clip
    regions = [crop_box(box, frames[0].shape, MARGIN) for box in track.boxes]
    on_device = device_crops(torch.from_numpy(np.stack(frames)), regions, 256)
    reference = np.stack([face_crop(f, r, 256) for f, r in zip(frames, regions, strict=True)]).astype(np.float32)
    ours = on_device.permute(0, 2, 3, 1).numpy() * 255.0
    difference = np.abs(ours - reference)
    assert on_device.shape == (8, 3, 256, 256) and 0.0 <= float(on_device.min()) <= float(on_device.max()) <= 1.0
    assert float(difference.mean()) < CROP_MEAN and float(difference.max()) < CROP_MAX, (
        float(difference.mean()),
        float(difference.max()),
    )


SHOWN = [0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5]  # the source frame of each of 11 output frames over 8 (ping-pong)


def both_paths(models, clip, mask: str, *, same_latents: bool) -> tuple[list, list]:
    """11 output frames (cycling) in batches of 4 through the reference path, then the device path; with
    `same_latents` the device path starts from the reference path's VAE latents (its crops never run)."""
    frames, track = clip
    landmarks = track.landmarks if mask == "jaw" else None
    features = prompts(models, 11)
    reference, ours = [], []
    kept = SourceLatents(models, keep=True)
    run_lipsync(
        models,
        frames,
        track.boxes,
        features,
        num_frames=11,
        batch_size=4,
        extra_margin=MARGIN,
        sink=reference.append,
        control=StageControl(),
        landmarks=landmarks,
        path="reference",
        latents=kept,
    )
    seeded = SourceLatents(models, keep=True, kept=dict(kept.kept)) if same_latents else None
    run_lipsync(
        models,
        frames,
        track.boxes,
        features,
        num_frames=11,
        batch_size=4,
        extra_margin=MARGIN,
        sink=ours.append,
        control=StageControl(),
        landmarks=landmarks,
        path="device",
        latents=seeded,
    )
    assert len(ours) == len(reference) == 11 and (seeded is None or seeded.encoded == 0)
    return ours, reference


def regions_of(clip, i: int):
    frames, track = clip
    source = frames[SHOWN[i]]
    x1, y1, x2, y2 = crop_box(track.boxes[SHOWN[i]], source.shape, MARGIN)
    outside = np.ones(source.shape[:2], bool)
    outside[y1:y2, x1:x2] = False
    return source, (slice(y1, y2), slice(x1, x2)), outside


@pytest.mark.parametrize("mask", ["jaw", "rectangle"])
def test_device_path_equals_the_reference_path_from_the_same_latents(models, clip, mask):
    """From the same VAE latents, the device path's UNet + decode + device blend + copy back give the
    reference path's frames to within 2 levels (rounding of the resize), and outside each face region
    both are bit for bit the source frame."""
    ours, reference = both_paths(models, clip, mask, same_latents=True)
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        source, box, outside = regions_of(clip, i)
        assert np.array_equal(a[outside], source[outside]) and np.array_equal(b[outside], source[outside])
        assert np.abs(a.astype(int) - b).max() <= 2, i
        assert not np.array_equal(a[box], source[box])  # the face was re-drawn


@pytest.mark.parametrize("mask, mean_bound, far_bound", [("jaw", 3.5, 0.03), ("rectangle", 6.5, 0.06)])
def test_device_path_stays_near_the_reference_path_end_to_end(models, clip, mask, mean_bound, far_bound):
    """With its own crops (bicubic with antialiasing instead of Lanczos, a mean difference under 1.5 levels,
    test above), the device path's frames stay near the reference's: inside the face region the mean
    difference is under `mean_bound` levels and under `far_bound` of the pixels are more than 32 levels
    off. These random-weight tiny models amplify input differences far more than trained ones would (on the
    tiny models: means 1.9 to 3.0 for jaw, 4.4 to 5.7 for the rectangle; 1 to 2 % and 3.4 to 4.8 % far)."""
    ours, reference = both_paths(models, clip, mask, same_latents=False)
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        source, box, outside = regions_of(clip, i)
        assert np.array_equal(a[outside], source[outside])
        difference = np.abs(a[box].astype(int) - b[box])
        assert float(difference.mean()) < mean_bound and float((difference > 32).mean()) < far_bound, (
            i,
            float(difference.mean()),
            float((difference > 32).mean()),
        )


def test_device_blend_of_the_same_faces_equals_the_reference_blend(models, clip):
    """With the re-drawn crops held equal, the device blend and the OpenCV blend differ by rounding only."""
    from app.pipeline.lipsync.inference import blend_mouth, blend_on_device, jaw_mask

    frames, track = clip
    regions = [crop_box(box, frames[0].shape, MARGIN) for box in track.boxes[:4]]
    masks = [jaw_mask(points, region) for points, region in zip(track.landmarks[:4], regions, strict=True)]
    redrawn = torch.randint(0, 256, (4, 3, 256, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ours = blend_on_device(torch.from_numpy(np.stack(frames[:4])), redrawn, regions, masks).numpy()
    for i in range(4):
        reference = blend_mouth(frames[i], redrawn[i].permute(1, 2, 0).numpy(), regions[i], masks[i])
        assert np.abs(ours[i].astype(int) - reference).max() <= 2


def test_audio_windows_per_batch_equal_window_features():
    hidden = torch.randn(130, 3, 8, generator=torch.Generator().manual_seed(0))
    for fps in (25.0, 29.97, 60.0):
        count = int(130 / 50 * fps) + 5  # past the audio's end too
        whole = window_features(hidden, fps=fps, num_frames=count, padding_left=2, padding_right=2)
        windows = AudioWindows(hidden, fps=fps, num_frames=count, padding_left=2, padding_right=2)
        parts = torch.cat([windows[start : start + 7] for start in range(0, count, 7)])
        assert len(windows) == count and torch.equal(parts, whole)


def test_whisper_windows_in_one_batch_equal_one_at_a_time(models):
    """Audio longer than WHISPER_WINDOWS_PER_PASS windows: encoded in batched passes, as encoding each 30 s
    window alone and concatenating."""
    rng = np.random.default_rng(4)
    seconds = 30 * WHISPER_WINDOWS_PER_PASS + 12
    samples = (0.1 * rng.standard_normal(seconds * WHISPER_SAMPLE_RATE)).astype(np.float32)
    batched = whisper_hidden_states(models, samples)
    window = 30 * WHISPER_SAMPLE_RATE
    alone = torch.cat(
        [
            whisper_hidden_states(models, samples[start : start + window])
            if start + window <= samples.size
            else whisper_hidden_states(models, samples[start:])
            for start in range(0, samples.size, window)
        ]
    )
    assert batched.shape == (seconds * 50, models.audio_layers, models.audio_dim)
    assert torch.allclose(batched, alone, atol=1e-4)


def test_a_padded_last_batch_gives_the_unpadded_faces(models, clip):
    frames, track = clip
    regions = [crop_box(box, frames[0].shape, MARGIN) for box in track.boxes[:3]]
    latents = encode_pixels(models, device_crops(torch.from_numpy(np.stack(frames[:3])), regions, 256))
    audio = prompts(models, 3)
    plain, padded = redraw_faces(models, latents, audio), redraw_faces(models, latents, audio, pad_to=8)
    assert padded.shape == plain.shape == (3, 3, 256, 256)
    assert (plain.int() - padded.int()).abs().max() <= 1


def test_source_latents_seeded_from_a_cache_encode_nothing_new(models, clip):
    frames, track = clip
    regions = [crop_box(box, frames[0].shape, MARGIN) for box in track.boxes]
    first = SourceLatents(models, keep=True)
    direct = first(list(range(8)), frames, regions)
    again = SourceLatents(models, keep=True, kept={i: t.clone() for i, t in first.kept.items()})
    assert torch.equal(again([3, 4], [frames[3], frames[4]], regions[3:5]), direct[3:5]) and again.encoded == 0


def test_read_ahead_keeps_order_raises_errors_and_stops_when_closed():
    assert list(read_ahead(iter(range(50)), depth=3)) == list(range(50))

    def failing():
        yield 1
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        list(read_ahead(failing()))
    produced = []

    def endless():
        for i in range(10_000):
            produced.append(i)
            yield i

    before = threading.active_count()
    items = read_ahead(endless(), depth=2)
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    items.close()
    assert threading.active_count() == before and len(produced) < 10


def test_warm_up_runs_a_batch_at_the_devices_default_size(tmp_path_factory):
    from app.pipeline.lipsync.stages import LipsyncModels

    holder = LipsyncModels(tiny_musetalk_profile(tmp_path_factory), "keep_loaded", device="cpu")
    calls = []
    unet = holder.musetalk().unet
    original = unet.forward
    unet.forward = lambda sample, *a, **kw: (calls.append(sample.shape[0]), original(sample, *a, **kw))[1]
    try:
        assert holder.warm_up() > 0
    finally:
        del unet.forward
    assert calls == [holder.batch_size()] == [holder.profile.default_batch_size]
