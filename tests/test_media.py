"""app/pipeline/media/ against the real ffmpeg/ffprobe: probing, audio extraction, frame cache, writer, final mux.

Clips are built from scikit-image's astronaut photo (320x240, so a width/height swap would show) with the
module's own helpers. The mux tests give the picture a loud 1000 Hz track of its own and check, by decoding
and correlating, that only the driving audio reaches the output.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import wave
from pathlib import Path

import cv2
import numpy as np
import pytest
from skimage import data

from app.pipeline.control import Canceled, StageControl
from app.pipeline.media.decode import FrameCache, decode_frames, extract_audio
from app.pipeline.media.encode import VideoWriter, pick_h264_encoder
from app.pipeline.media.ffmpeg import MediaError
from app.pipeline.media.mux import mux
from app.pipeline.media.probe import probe
from app.pipeline.media.samples import make_face_video, make_speech, make_test_tone

W, H, FPS = 320, 240, 25


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    return cv2.resize(data.astronaut(), (W, H), interpolation=cv2.INTER_AREA)


@pytest.fixture(scope="module")
def clips(tmp_path_factory, image) -> dict[str, Path]:
    """Shared inputs: a still clip without audio, a moving clip with its own loud tone, driving speech."""
    root = tmp_path_factory.mktemp("media")
    own = make_test_tone(root / "own.wav", 7.0, 1000.0, amplitude=0.9)
    speech_kind = make_speech(root / "drive.wav", "Hello, this is the driving audio of a lip sync test.")
    return {
        "root": root,
        "own": own,
        "drive": root / "drive.wav",
        "speech_kind": speech_kind,  # type: ignore[dict-item]
        "still": make_face_video(root / "still.mp4", image, 2.0, FPS, motion=False),
        "talk": make_face_video(root / "talk.mp4", image, 3.0, FPS, audio=own),
        "long": make_face_video(root / "long.mp4", image, 6.0, FPS, audio=own),
        "short": make_face_video(root / "short.mp4", image, 1.0, FPS, audio=own),
    }


def read_wav(path: Path) -> tuple[np.ndarray, int, int]:
    """(float samples of channel 0, sample rate, channels)."""
    with wave.open(str(path)) as handle:
        channels, rate = handle.getnchannels(), handle.getframerate()
        assert handle.getsampwidth() == 2
        pcm = np.frombuffer(handle.readframes(handle.getnframes()), dtype="<i2").reshape(-1, channels)
    return pcm[:, 0].astype(np.float64) / 32768.0, rate, channels


def best_correlation(a: np.ndarray, b: np.ndarray, max_lag: int) -> float:
    """Largest normalized correlation of a and b over shifts of up to max_lag samples (codec delay)."""
    n = min(len(a), len(b))
    assert n > 4 * max_lag
    a = (a[:n] - a[:n].mean()) / (a[:n].std() + 1e-12)
    b = (b[:n] - b[:n].mean()) / (b[:n].std() + 1e-12)
    size = 1 << (2 * n - 1).bit_length()
    full = np.fft.irfft(np.fft.rfft(a, size) * np.conj(np.fft.rfft(b, size)), size)
    lags = np.concatenate([full[: max_lag + 1], full[-max_lag:]])  # b shifted by 0..max_lag either way
    return float(lags.max() / n)


def video_stream(path: Path) -> dict:
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_streams", "-of", "json", str(path)],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout
    return json.loads(out)["streams"][0]


def packet_hashes(path: Path) -> list[str]:
    """MD5 of every video packet, without decoding: equal lists mean a bit-identical stream copy."""
    out = subprocess.run(
        ["ffmpeg", "-v", "error", "-i", str(path), "-map", "0:v:0", "-c", "copy", "-f", "framemd5", "-"],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout.decode()
    return [line.rsplit(",", 1)[1].strip() for line in out.splitlines() if line and not line.startswith("#")]


def write_picture(path: Path, frames, count: int, fps=FPS) -> Path:
    with VideoWriter(path, width=W, height=H, fps=fps) as writer:
        for i in range(count):
            writer.write(frames[i % len(frames)])
    return path


# -- probe ---------------------------------------------------------------------------------------------


def test_probe_video_with_audio(clips):
    info = probe(clips["talk"])
    assert info.has_video and info.has_audio
    assert (info.width, info.height, info.fps, info.frame_count) == (W, H, 25.0, 75)
    assert (info.video_codec, info.audio_codec, info.rotation) == ("h264", "aac", 0)
    assert info.video_duration_s == pytest.approx(3.0, abs=0.01)
    assert info.audio_duration_s == pytest.approx(3.0, abs=0.03)
    assert info.duration_s == pytest.approx(3.0, abs=0.05)


def test_probe_video_without_audio(clips):
    info = probe(clips["still"])
    assert info.has_video and not info.has_audio and info.audio_codec is None and info.audio_duration_s is None
    assert (info.fps, info.frame_count) == (25.0, 50)


def test_probe_audio_file(clips):
    mp3 = make_test_tone(clips["root"] / "tone.mp3", 1.5, 440.0)
    info = probe(mp3)
    assert not info.has_video and info.has_audio and info.audio_codec == "mp3"
    assert info.fps is None and info.frame_count == 0
    assert info.duration_s == pytest.approx(1.5, abs=0.1)


def test_probe_counts_frames_when_container_has_no_count(clips):
    mkv = clips["root"] / "still.mkv"
    subprocess.run(
        ["ffmpeg", "-v", "error", "-y", "-i", str(clips["still"]), "-c", "copy", str(mkv)], check=True, timeout=30
    )
    assert "nb_frames" not in video_stream(mkv)
    info = probe(mkv)
    assert info.frame_count == 50 and info.video_duration_s == pytest.approx(2.0, abs=0.05)


def test_garbage_and_missing_files_are_refused(tmp_path):
    garbage = tmp_path / "clip.mp4"
    garbage.write_bytes(np.random.default_rng(0).bytes(50_000))
    with pytest.raises(MediaError, match="cannot be read as media"):
        probe(garbage)
    with pytest.raises(MediaError, match="does not exist"):
        probe(tmp_path / "nothing.mp4")


def test_rotated_video_is_probed_and_decoded_upright(clips, image, tmp_path):
    rotated = tmp_path / "rotated.mp4"
    subprocess.run(
        [
            "ffmpeg",
            "-v",
            "error",
            "-y",
            "-i",
            str(clips["still"]),
            "-c",
            "copy",
            "-metadata:s:v:0",
            "rotate=90",
            str(rotated),
        ],
        check=True,
        timeout=30,
    )
    info = probe(rotated)
    assert info.rotation in (90, 270) and (info.width, info.height) == (H, W)
    cache = decode_frames(rotated, tmp_path / "rotated.raw")
    expected = np.rot90(image, 1 if info.rotation == 270 else -1)
    assert cache[0].shape == (W, H, 3)
    assert np.abs(cache[0].astype(int) - expected).mean() < 4


# -- audio ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["talk", "mp3"])
def test_extract_audio_gives_16k_mono_of_the_right_length(clips, source, tmp_path):
    src = clips["talk"] if source == "talk" else make_test_tone(tmp_path / "stereo.mp3", 2.0, 300.0)
    expected = probe(src).audio_duration_s
    out = extract_audio(src, tmp_path / "speech16k.wav")
    samples, rate, channels = read_wav(out)
    assert (rate, channels) == (16000, 1)
    assert len(samples) / 16000 == pytest.approx(expected, abs=0.08)
    assert np.abs(samples).max() > 0.2  # real sound, not silence


def test_extract_audio_from_video_without_sound_fails(clips, tmp_path):
    with pytest.raises(MediaError, match="no audio"):
        extract_audio(clips["still"], tmp_path / "x.wav")
    assert not (tmp_path / "x.wav").exists()


def test_make_speech_uses_espeak_when_present(tmp_path):
    import shutil

    kind = make_speech(tmp_path / "s.wav", "-- testing one two three")
    assert kind == ("espeak-ng" if shutil.which("espeak-ng") else "tone")
    assert probe(tmp_path / "s.wav").duration_s > 0.5


# -- frame cache ---------------------------------------------------------------------------------------


def test_decode_frames_exact_count_and_content(clips, image, tmp_path):
    reports: list[str] = []
    control = StageControl(report=lambda fraction, detail: reports.append(detail))
    cache = decode_frames(clips["still"], tmp_path / "still.raw", control=control)
    assert len(cache) == 50 and cache.fps == 25.0
    assert (tmp_path / "still.raw").stat().st_size == 50 * H * W * 3
    for index in (0, 17, 49, -1):
        frame = cache[index]
        assert frame.shape == (H, W, 3) and frame.dtype == np.uint8
        assert np.abs(frame.astype(int) - image).mean() < 4  # yuv420 + x264 crf 18 loss only
    with pytest.raises(IndexError):
        cache[50]
    assert reports[-1] == "50/50 frames" and len(reports) == 50
    cache.close()
    assert np.abs(FrameCache(tmp_path / "still.raw", 50, H, W)[3].astype(int) - image).mean() < 4


def test_decode_frames_of_moving_clip_differ(clips, tmp_path):
    cache = decode_frames(clips["talk"], tmp_path / "talk.raw")
    assert len(cache) == 75
    assert np.abs(cache[0].astype(int) - cache[30].astype(int)).mean() > 5


def test_decode_cancel_and_timeout_remove_the_cache(clips, tmp_path):
    control = StageControl(cancel_requested=lambda: len(list(tmp_path.glob("*.raw"))) > 0)
    with pytest.raises(Canceled):
        decode_frames(clips["talk"], tmp_path / "c.raw", control=control)
    assert not (tmp_path / "c.raw").exists()
    with pytest.raises(MediaError, match="timed out"):
        decode_frames(clips["long"], tmp_path / "t.raw", timeout_s=0.001)
    assert not (tmp_path / "t.raw").exists()


# -- writer --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fps, expected_rate", [(25, "25/1"), (30000 / 1001, "30000/1001")])
def test_video_writer_writes_exactly_n_frames(clips, tmp_path, fps, expected_rate):
    frames = decode_frames(clips["talk"], tmp_path / "talk.raw")
    out = write_picture(tmp_path / "out.mp4", frames, 37, fps=fps)
    stream = video_stream(out)
    assert int(stream["nb_frames"]) == 37
    assert stream["avg_frame_rate"] == expected_rate and stream["pix_fmt"] == "yuv420p"
    assert stream["codec_name"] == "h264" and stream.get("has_b_frames", 0) == 0
    back = decode_frames(out, tmp_path / "back.raw")
    assert len(back) == 37
    assert np.abs(back[36].astype(int) - frames[36].astype(int)).mean() < 4
    assert not list(tmp_path.glob(".*part*"))


def test_video_writer_abort_leaves_nothing(image, tmp_path):
    target = tmp_path / "aborted.mp4"
    with pytest.raises(RuntimeError, match="upstream"):
        with VideoWriter(target, width=W, height=H, fps=FPS, encoder="libx264") as writer:
            for _ in range(5):
                writer.write(image)
            raise RuntimeError("upstream failure")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):
        with VideoWriter(target, width=W, height=H, fps=FPS) as writer:
            writer.write(image[:100])
    with pytest.raises(MediaError, match="no frames"):
        with VideoWriter(target, width=W, height=H, fps=FPS):
            pass
    assert list(tmp_path.iterdir()) == []


def test_video_writer_reports_a_dead_encoder(image, tmp_path):
    with pytest.raises(MediaError, match="(?i)unknown encoder") as failure:
        with VideoWriter(tmp_path / "x.mp4", width=W, height=H, fps=FPS, encoder="no_such_h264") as writer:
            for _ in range(200):
                writer.write(image)
    assert "x.mp4" in str(failure.value)
    assert list(tmp_path.iterdir()) == []


def test_video_writer_crops_odd_sizes_to_even(image, tmp_path):
    odd = np.ascontiguousarray(image[:101, :151])
    with VideoWriter(tmp_path / "odd.mp4", width=151, height=101, fps=FPS) as writer:
        for _ in range(3):
            writer.write(odd)
    info = probe(tmp_path / "odd.mp4")
    assert (info.width, info.height, info.frame_count) == (150, 100, 3)


def test_pick_h264_encoder_is_cached_and_usable():
    first = pick_h264_encoder()
    assert first in ("h264_nvenc", "libx264")
    if not os.path.exists("/dev/nvidia0"):
        assert first == "libx264"
    assert pick_h264_encoder() == first


# -- mux -----------------------------------------------------------------------------------------------


def test_mux_copies_a_picture_that_covers_the_audio(clips, tmp_path):
    frames = decode_frames(clips["talk"], tmp_path / "talk.raw")
    picture = write_picture(tmp_path / "picture.mp4", frames, 100)  # 4.0 s
    audio = make_test_tone(tmp_path / "drive.wav", 2.5, 440.0)
    out = mux(picture, audio, tmp_path / "final.mp4", audio_duration_s=2.5, picture_duration_s=4.0, timeout_s=60)
    info = probe(out)
    assert info.audio_codec == "aac" and info.duration_s == pytest.approx(2.5, abs=1 / FPS + 1e-3)
    assert info.frame_count == 63  # frames with pts < 2.5 s
    source, copied = video_stream(picture), video_stream(out)
    for key in ("codec_name", "profile", "width", "height", "pix_fmt", "level", "avg_frame_rate", "time_base"):
        assert copied[key] == source[key], key
    hashes = packet_hashes(out)
    assert hashes == packet_hashes(picture)[:63]


def test_mux_loops_and_reencodes_a_shorter_picture(clips, tmp_path):
    frames = decode_frames(clips["talk"], tmp_path / "talk.raw")
    picture = write_picture(tmp_path / "picture.mp4", frames, 25)  # 1.0 s
    audio = make_test_tone(tmp_path / "drive.wav", 2.9, 440.0)
    out = mux(picture, audio, tmp_path / "final.mp4", timeout_s=60)  # durations probed
    info = probe(out)
    assert info.duration_s == pytest.approx(2.9, abs=1 / FPS + 1e-3)
    assert info.video_duration_s == pytest.approx(2.9, abs=1 / FPS + 1e-3)
    assert info.frame_count == 73
    assert packet_hashes(out)[:25] != packet_hashes(picture)  # re-encoded, not copied
    looped = decode_frames(out, tmp_path / "looped.raw")
    assert np.abs(looped[25].astype(int) - frames[0].astype(int)).mean() < 5  # second pass starts over
    assert np.abs(looped[50].astype(int) - frames[0].astype(int)).mean() < 5


@pytest.mark.parametrize("picture_key", ["long", "short"])  # copy path and loop path
def test_mux_sound_comes_only_from_the_driving_audio(clips, picture_key, tmp_path):
    drive = clips["drive"]
    drive_s = probe(drive).duration_s
    out = mux(clips[picture_key], drive, tmp_path / "final.mp4", timeout_s=60)
    expected_path = "copy" if picture_key == "long" else "loop"
    assert (packet_hashes(out)[:10] == packet_hashes(clips[picture_key])[:10]) == (expected_path == "copy")
    assert probe(out).duration_s == pytest.approx(drive_s, abs=1 / FPS + 0.03)
    decoded = {
        name: read_wav(extract_audio(path, tmp_path / f"{name}.wav"))[0]
        for name, path in (("out", out), ("drive", drive), ("own", clips["own"]))
    }
    max_lag = 1600  # 0.1 s at 16 kHz: covers AAC priming/resampler delays
    with_drive = best_correlation(decoded["drive"], decoded["out"], max_lag)
    with_own = best_correlation(decoded["own"], decoded["out"], max_lag)
    assert with_drive > 0.8, (with_drive, with_own)
    assert with_own < 0.1, (with_drive, with_own)


def test_mux_failure_raises_with_ffmpegs_message(clips, tmp_path):
    garbage = tmp_path / "audio.wav"
    garbage.write_bytes(b"RIFF" + np.random.default_rng(1).bytes(4000))
    with pytest.raises(MediaError) as failure:
        mux(clips["still"], garbage, tmp_path / "final.mp4", audio_duration_s=2.0, picture_duration_s=2.0, timeout_s=30)
    assert "exited with" in str(failure.value) and "audio.wav" in str(failure.value)
    with pytest.raises(MediaError, match="matches no streams"):  # "audio" without sound
        mux(
            clips["long"],
            clips["still"],
            tmp_path / "final.mp4",
            audio_duration_s=2.0,
            picture_duration_s=6.0,
            timeout_s=30,
        )
    with pytest.raises(MediaError, match="does not exist"):
        mux(tmp_path / "missing.mp4", clips["drive"], tmp_path / "final.mp4", timeout_s=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audio.wav"]


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_mux_timeout_kills_ffmpeg_and_cleans_up(clips, tmp_path):
    fifo = tmp_path / "never_written.wav"
    os.mkfifo(fifo)  # ffmpeg blocks opening it forever
    started = time.monotonic()
    with pytest.raises(MediaError, match="timed out"):
        mux(clips["short"], fifo, tmp_path / "final.mp4", audio_duration_s=3.0, picture_duration_s=1.0, timeout_s=1.0)
    assert time.monotonic() - started < 10
    assert processes_mentioning(str(fifo)) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["never_written.wav"]
