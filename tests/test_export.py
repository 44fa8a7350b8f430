"""WAV/MP3/JSON export: headers, sample values, durations, and loud failures instead of empty files."""

from __future__ import annotations

import json
import shutil
import tempfile
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from app.pipeline.media.decode import extract_audio
from app.pipeline.media.ffmpeg import MediaError, MediaTools
from app.pipeline.music.export import (
    MP3_ENCODER_DELAY_SAMPLES,
    MP3_FRAME_SAMPLES,
    ExportError,
    probe_duration,
    write_metadata,
    write_mp3,
    write_wav,
)
from app.pipeline.profiles import load_profile


@pytest.fixture
def profile(tmp_path):
    return load_profile("tiny", tmp_path)


def stereo(frames: int, seed: int = 0) -> torch.Tensor:
    """A tone per channel plus a little noise: loud enough that MP3 keeps it."""
    t = torch.arange(frames) / 44100
    noise = torch.randn(2, frames, generator=torch.Generator().manual_seed(seed)) * 0.01
    return torch.stack([0.5 * torch.sin(2 * torch.pi * 440 * t), 0.3 * torch.sin(2 * torch.pi * 660 * t)]) + noise


def read_pcm(path) -> tuple[wave._wave_params, np.ndarray]:
    with wave.open(str(path), "rb") as wav:
        params = wav.getparams()
        frames = np.frombuffer(wav.readframes(params.nframes), dtype="<i2").reshape(-1, params.nchannels)
    return params, frames


def test_wav_header_and_samples(profile, tmp_path):
    sr = profile.codec.sample_rate
    audio = stereo(3 * 2048 + 5)
    path = write_wav(audio, tmp_path / "song.wav", sr)
    params, pcm = read_pcm(path)
    assert (params.nchannels, params.sampwidth, params.framerate, params.nframes) == (2, 2, 44100, 3 * 2048 + 5)
    assert path.stat().st_size == 44 + (3 * 2048 + 5) * 4  # canonical 44-byte header, no extra chunks
    np.testing.assert_allclose(pcm.T / 32767.0, audio.numpy(), atol=0.6 / 32767)  # channel 0 is left


def test_wav_clips_instead_of_wrapping(tmp_path):
    audio = torch.tensor([[2.0, -3.0, 1.0, 0.0], [0.5, -0.5, -1.0, 1e-6]])
    _, pcm = read_pcm(write_wav(audio, tmp_path / "loud.wav", 44100))
    assert pcm[:, 0].tolist() == [32767, -32767, 32767, 0]
    assert pcm[:, 1].tolist() == [16384, -16384, -32767, 0]


def test_wav_rejects_bad_audio(tmp_path):
    with pytest.raises(ValueError, match="channels"):
        write_wav(torch.zeros(1000), tmp_path / "a.wav", 44100)
    with pytest.raises(ValueError, match="channels"):
        write_wav(torch.zeros(3, 1000), tmp_path / "a.wav", 44100)
    with pytest.raises(ValueError, match="NaN"):
        write_wav(torch.full((2, 10), float("nan")), tmp_path / "a.wav", 44100)
    assert list(tmp_path.iterdir()) == []


def test_mp3_duration_matches_wav(profile, tmp_path):
    sr, frames = profile.codec.sample_rate, 44100 + 777
    wav_path = write_wav(stereo(frames), tmp_path / "song.wav", sr)
    mp3 = write_mp3(wav_path, tmp_path / "song.mp3")
    with open(mp3, "rb") as f:
        head = f.read(3)
    assert head == b"ID3" or head[0] == 0xFF
    slack = (MP3_FRAME_SAMPLES + MP3_ENCODER_DELAY_SAMPLES) / sr
    assert frames / sr <= probe_duration(mp3) <= frames / sr + slack
    stream = json.loads(
        subprocess.run(
            ["ffprobe", "-v", "error", "-show_streams", "-of", "json", str(mp3)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )["streams"][0]
    assert (stream["codec_name"], stream["channels"], int(stream["sample_rate"])) == ("mp3", 2, 44100)
    assert abs(int(stream["bit_rate"]) - 320_000) <= 1000
    decoded = subprocess.run(
        ["ffmpeg", "-v", "error", "-i", str(mp3), "-f", "s16le", "-"], capture_output=True, check=True
    ).stdout
    assert abs(len(decoded) // 4 - frames) <= MP3_FRAME_SAMPLES  # ffmpeg trims the encoder delay


def test_mp3_ffmpeg_failure_raises_and_leaves_no_file(tmp_path):
    wav_path = write_wav(stereo(4410), tmp_path / "song.wav", 44100)
    with pytest.raises(ExportError, match=r"(?s)^encoding song\.wav to MP3 at abc: ffmpeg exited with 1:\n.*abc"):
        write_mp3(wav_path, tmp_path / "song.mp3", bitrate="abc")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["song.wav"]


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_a_bad_ffmpeg_is_a_clear_export_error_shaped_like_the_lipsync_ones(tmp_path):
    """The export and the lip-sync media calls fail with one error type and one message shape."""
    wav_path = write_wav(stereo(4410), tmp_path / "song.wav", 44100)
    export, lipsync = "encoding song.wav to MP3 at 320k", f"extracting audio of {wav_path}"
    missing = str(tmp_path / "no" / "ffmpeg")
    tools = MediaTools(ffmpeg=missing)
    with pytest.raises(ExportError) as failed:
        write_mp3(wav_path, tmp_path / "song.mp3", tools=tools)
    assert isinstance(failed.value, MediaError) and str(failed.value) == f"{export}: {missing} not found"
    with pytest.raises(MediaError) as failed:
        extract_audio(wav_path, tmp_path / "16k.wav", tools=tools)
    assert str(failed.value) == f"{lipsync}: {missing} not found"

    broken = _script(tmp_path / "broken-ffmpeg", 'echo "banner line" >&2; echo "fatal: no encoder here" >&2; exit 3\n')
    tools = MediaTools(ffmpeg=broken)
    said = "broken-ffmpeg exited with 3:\nbanner line\nfatal: no encoder here"
    with pytest.raises(ExportError) as failed:
        write_mp3(wav_path, tmp_path / "song.mp3", tools=tools)
    assert str(failed.value) == f"{export}: {said}"
    with pytest.raises(MediaError) as failed:
        extract_audio(wav_path, tmp_path / "16k.wav", tools=tools)
    assert str(failed.value) == f"{lipsync}: {said}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken-ffmpeg", "song.wav"]


@pytest.mark.parametrize("ffmpeg", ["/bin/false", "killed"])
def test_a_failed_or_killed_mp3_encode_leaves_nothing_in_the_temp_folder(tmp_path, monkeypatch, ffmpeg):
    """Issue 36, item 2: pydub's export copied the song to $TMPDIR first and left it there when ffmpeg failed."""
    temp = tmp_path / "tmpdir"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    if ffmpeg == "killed":
        ffmpeg = _script(tmp_path / "killed-ffmpeg", "kill -9 $$\n")
    wav_path = write_wav(stereo(44100), tmp_path / "song.wav", 44100)
    with pytest.raises(ExportError, match=r"^encoding song\.wav to MP3 at 320k: .*(false|killed-ffmpeg) "):
        write_mp3(wav_path, tmp_path / "song.mp3", tools=MediaTools(ffmpeg=ffmpeg))
    assert list(temp.iterdir()) == []
    assert not (tmp_path / "song.mp3").exists() and not list(tmp_path.glob(".song.mp3.*"))


def test_the_export_runs_the_ffmpeg_and_ffprobe_it_is_given(tmp_path):
    """The tools name wrappers that log each call, then run the real tools."""
    log = tmp_path / "calls.log"
    wrappers = {}
    for tool in ("ffmpeg", "ffprobe"):
        real = shutil.which(tool)
        assert real is not None
        wrappers[tool] = _script(tmp_path / f"logged-{tool}", f'echo "{tool} $*" >> "{log}"\nexec "{real}" "$@"\n')
    tools = MediaTools(**wrappers)
    wav_path = write_wav(stereo(44100), tmp_path / "song.wav", 44100)
    mp3 = write_mp3(wav_path, tmp_path / "song.mp3", tools=tools)
    assert (
        1.0 <= probe_duration(mp3, tools=tools) <= 1.0 + (MP3_FRAME_SAMPLES + MP3_ENCODER_DELAY_SAMPLES) / 44100 + 1e-3
    )
    calls = log.read_text().splitlines()
    encodes = [c for c in calls if c.startswith("ffmpeg ") and "-f mp3" in c and "-b:a 320k" in c]
    probes = [c for c in calls if c.startswith("ffprobe ")]
    assert len(encodes) == 1, calls
    assert len(probes) == 2, calls  # the check inside write_mp3, then the one above


def test_mp3_from_bad_wav_raises(tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF not really a wav file")
    with pytest.raises(ExportError, match="cannot read WAV"):
        write_mp3(bad, tmp_path / "out.mp3")
    with pytest.raises(ExportError, match="cannot read WAV"):
        write_mp3(tmp_path / "missing.wav", tmp_path / "out.mp3")
    assert not (tmp_path / "out.mp3").exists()


def test_metadata_round_trip(tmp_path):
    meta = {"job": "j1", "duration_s": 5.0, "tags": ["Pop", "café"], "wav": tmp_path / "a.wav"}
    path = write_metadata(tmp_path / "out" / "meta.json", meta)
    assert json.loads(path.read_text(encoding="utf-8")) == {**meta, "wav": str(tmp_path / "a.wav")}
    with pytest.raises(TypeError, match="set"):
        write_metadata(tmp_path / "bad.json", {"x": {1, 2}})
    assert not (tmp_path / "bad.json").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["meta.json"]
