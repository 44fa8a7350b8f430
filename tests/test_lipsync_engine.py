"""The MuseTalk procedure end to end on tiny random-weight models and a real face photo."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from app.pipeline.control import Canceled, StageControl
from app.pipeline.lipsync.faces import crop_box, detect_faces, fill_missing
from app.pipeline.lipsync.frames import output_frame_count, pingpong_index
from app.pipeline.lipsync.inference import (
    SourceLatents,
    audio_features,
    read_wav_16k,
    run_lipsync,
    whisper_hidden_states,
    window_features,
)
from app.pipeline.lipsync.musetalk import load_musetalk
from harness.media import astronaut_frames, write_wav
from harness.models import tiny_musetalk_profile

MARGIN = 10
LAYERS, DIM = 3, 64  # tiny whisper: embedding output + 2 layers, d_model 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_musetalk(tiny_musetalk_profile(tmp_path_factory), "cpu")


@pytest.fixture(scope="module")
def clip():
    frames = astronaut_frames(5)
    return frames, fill_missing(detect_faces(frames))


@pytest.fixture(scope="module")
def features(models, tmp_path_factory):
    wav = write_wav(tmp_path_factory.mktemp("audio") / "voice.wav", 0.5)
    return audio_features(models, wav, fps=25, num_frames=12, padding_left=2, padding_right=2)


class Recorder:
    def __init__(self, cancel_after: int | None = None):
        self.reports: list[tuple[float, str]] = []
        self.cancel_after = cancel_after
        self.control = StageControl(
            report=lambda f, d: self.reports.append((f, d)),
            cancel_requested=lambda: self.cancel_after is not None and len(self.reports) >= self.cancel_after,
        )


def test_run_lipsync_writes_every_frame_in_pingpong_order(models, clip, features):
    frames, boxes = clip
    out: list[np.ndarray] = []
    recorder = Recorder()
    written = run_lipsync(
        models,
        frames,
        boxes,
        features,
        num_frames=11,
        batch_size=4,
        extra_margin=MARGIN,
        sink=out.append,
        control=recorder.control,
    )
    assert written == 11 and len(out) == 11
    for i, frame in enumerate(out):
        source_index = pingpong_index(i, len(frames))
        source = frames[source_index]
        assert frame.shape == source.shape and frame.dtype == np.uint8
        assert abs(float(frame.mean()) - float(source.mean())) < 4, f"frame {i} brightness"
        x1, y1, x2, y2 = crop_box(boxes[source_index], source.shape, MARGIN)
        outside = np.ones(source.shape[:2], bool)
        outside[y1:y2, x1:x2] = False
        assert np.array_equal(frame[outside], source[outside]), f"frame {i} changed outside its face box"
        top = y1 + (y2 - y1) // 4
        assert np.array_equal(frame[y1:top, x1:x2], source[y1:top, x1:x2]), "upper face must stay"
        mouth = (slice((y1 + y2) // 2 + 3, y2 - 6), slice(x1 + 8, x2 - 8))
        assert np.abs(frame[mouth].astype(int) - source[mouth]).mean() > 2, "lower face was not re-drawn"
    assert [f for f, _ in recorder.reports] == pytest.approx([4 / 11, 8 / 11, 1.0])
    assert recorder.reports[-1][1] == "11/11 frames"


def test_batch_size_does_not_change_the_frames(models, clip, features):
    frames, boxes = clip
    whole, single = [], []
    run_lipsync(
        models,
        frames,
        boxes,
        features,
        num_frames=3,
        batch_size=3,
        extra_margin=MARGIN,
        sink=whole.append,
        control=StageControl(),
    )
    run_lipsync(
        models,
        frames,
        boxes,
        features,
        num_frames=3,
        batch_size=2,
        extra_margin=MARGIN,
        sink=single.append,
        control=StageControl(),
    )
    assert len(whole) == len(single) == 3
    for a, b in zip(whole, single, strict=True):
        assert np.abs(a.astype(int) - b).max() <= 1


def test_cycling_output_encodes_each_source_frame_once(models, clip, features):
    """11 output frames over 5 source frames: 5 crops through the VAE encoder, not 11, and the same frames."""
    frames, boxes = clip
    sources = [pingpong_index(i, len(frames)) for i in range(11)]
    originals = [frames[s] for s in sources]
    regions = [crop_box(boxes[s], frames[s].shape, MARGIN) for s in sources]
    kept, fresh = SourceLatents(models, keep=True), SourceLatents(models, keep=False)
    cached = torch.cat([kept(sources[i : i + 4], originals[i : i + 4], regions[i : i + 4]) for i in range(0, 11, 4)])
    direct = torch.cat([fresh(sources[i : i + 4], originals[i : i + 4], regions[i : i + 4]) for i in range(0, 11, 4)])
    assert (kept.encoded, fresh.encoded) == (len(frames), 11)
    assert torch.allclose(cached, direct, atol=1e-4)

    crops_encoded = []
    encode = models.vae.encode
    models.vae.encode = lambda images, **kw: (crops_encoded.append(images.shape[0] // 2), encode(images, **kw))[1]
    try:
        run_lipsync(
            models,
            frames,
            boxes,
            features,
            num_frames=11,
            batch_size=4,
            extra_margin=MARGIN,
            sink=lambda frame: None,
            control=StageControl(),
        )
        assert sum(crops_encoded) == len(frames)  # cycling: kept
        crops_encoded.clear()
        run_lipsync(
            models,
            frames,
            boxes,
            features,
            num_frames=4,
            batch_size=4,
            extra_margin=MARGIN,
            sink=lambda frame: None,
            control=StageControl(),
        )
        assert sum(crops_encoded) == 4  # no cycle: nothing worth keeping
    finally:
        del models.vae.encode


def test_a_failing_sink_stops_the_run_with_its_error(models, clip, features):
    frames, boxes = clip
    written = []

    def sink(frame):
        if len(written) == 5:
            raise BrokenPipeError("ffmpeg went away")
        written.append(frame)

    with pytest.raises(BrokenPipeError, match="ffmpeg went away"):
        run_lipsync(
            models,
            frames,
            boxes,
            features,
            num_frames=11,
            batch_size=2,
            extra_margin=MARGIN,
            sink=sink,
            control=StageControl(),
        )
    assert len(written) == 5


def test_audio_drives_the_mouth(models, clip, features):
    frames, boxes = clip
    outputs = []
    for prompt in (features[:1], torch.zeros_like(features[:1])):
        out: list[np.ndarray] = []
        run_lipsync(
            models,
            frames,
            boxes,
            prompt,
            num_frames=1,
            batch_size=1,
            extra_margin=MARGIN,
            sink=out.append,
            control=StageControl(),
        )
        outputs.append(out[0])
    assert not np.array_equal(outputs[0], outputs[1])


def test_cancel_stops_between_batches(models, clip, features):
    frames, boxes = clip
    out: list[np.ndarray] = []
    recorder = Recorder(cancel_after=1)
    with pytest.raises(Canceled):
        run_lipsync(
            models,
            frames,
            boxes,
            features,
            num_frames=11,
            batch_size=3,
            extra_margin=MARGIN,
            sink=out.append,
            control=recorder.control,
        )
    assert len(out) == 3 and len(recorder.reports) == 1


def test_inputs_are_checked(models, clip, features):
    frames, boxes = clip
    kwargs = dict(batch_size=2, extra_margin=MARGIN, sink=lambda f: None, control=StageControl())
    with pytest.raises(ValueError, match="face boxes"):
        run_lipsync(models, frames, boxes[:-1], features, num_frames=2, **kwargs)
    with pytest.raises(ValueError, match="face box"):
        run_lipsync(models, frames, [None] * len(frames), features, num_frames=2, **kwargs)
    with pytest.raises(ValueError, match="cover"):
        run_lipsync(models, frames, boxes, features, num_frames=len(features) + 1, **kwargs)


@pytest.mark.parametrize("seconds, fps", [(0.52, 25.0), (1.0, 30.0), (2.37, 25.0), (1.3, 29.97)])
def test_audio_features_give_one_prompt_per_video_frame(models, tmp_path, seconds, fps):
    wav = write_wav(tmp_path / "a.wav", seconds)
    num_frames = output_frame_count(seconds, fps)
    prompts = audio_features(models, wav, fps=fps, num_frames=num_frames, padding_left=2, padding_right=2)
    assert prompts.shape == (num_frames, 2 * (2 + 2 + 1) * LAYERS, DIM)
    assert torch.isfinite(prompts).all()
    assert prompts[num_frames // 2].abs().sum() > 0


def test_audio_longer_than_whisper_window_is_encoded_in_chunks(models, tmp_path):
    seconds, fps = 31.5, 25.0
    wav = write_wav(tmp_path / "long.wav", seconds)
    samples = read_wav_16k(wav)
    hidden = whisper_hidden_states(models, samples)
    assert hidden.shape == (int(seconds * 50), LAYERS, DIM)
    # frames after 30 s come from a second whisper window that starts at sample 480000
    second = whisper_hidden_states(models, samples[30 * 16000 :])
    assert torch.allclose(hidden[1500:], second, atol=1e-5)
    assert not torch.allclose(hidden[:75], second, atol=1e-3)
    num_frames = output_frame_count(seconds, fps)
    prompts = audio_features(models, wav, fps=fps, num_frames=num_frames, padding_left=2, padding_right=2)
    assert prompts.shape == (num_frames, 10 * LAYERS, DIM)
    assert prompts[780].abs().sum(dim=1).gt(0).all()  # 31.2 s: inside the second window


def test_window_features_follow_musetalks_indexing():
    # hidden[t, layer, :] = 10 * (t + 1) + layer, so zeros mark padding and positions are readable
    frames_50hz = 20
    hidden = (10 * (torch.arange(frames_50hz)[:, None] + 1) + torch.arange(LAYERS)[None, :]).float()
    hidden = hidden[:, :, None].expand(frames_50hz, LAYERS, 2)
    prompts = window_features(hidden, fps=25, num_frames=12, padding_left=2, padding_right=2)
    assert prompts.shape == (12, 10 * LAYERS, 2)
    times = (prompts[:, ::LAYERS, 0] // 10).long() - 1  # whisper frame of each of the 10 window slots
    for i in range(12):
        expected = [t if 0 <= t < frames_50hz else -1 for t in range(2 * i - 4, 2 * i + 6)]
        assert times[i].tolist() == expected, i
    assert prompts[3, :LAYERS, 0].tolist() == [30.0, 31.0, 32.0]  # (time, layer) order: frame 2, layers 0..2

    thirty = window_features(hidden, fps=30, num_frames=5, padding_left=2, padding_right=2)
    starts = (thirty[:, 4 * LAYERS, 0] // 10).long() - 1  # slot 4 = first frame after 2*2 padding slots
    assert starts.tolist() == [0, 1, 3, 5, 6]  # floor(i * 50 / 30)


def test_wav_must_be_16k(tmp_path):
    with pytest.raises(ValueError, match="16000 Hz"):
        read_wav_16k(write_wav(tmp_path / "cd.wav", 0.2, rate=44100))
