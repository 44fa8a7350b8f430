"""Writing a decoded song to disk: 16-bit stereo WAV, MP3 via pydub/ffmpeg, JSON metadata.

Every writer goes through a temporary file in the target folder and renames it into place, so a failed or
interrupted export never leaves a truncated or empty file under the final name.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
import wave
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

with warnings.catch_warnings():  # pydub imports audioop, deprecated since Python 3.11
    warnings.simplefilter("ignore", DeprecationWarning)
    from pydub import AudioSegment
    from pydub.exceptions import CouldntDecodeError, CouldntEncodeError
    from pydub.utils import mediainfo_json

# ffprobe's duration of an MP3 may exceed the audio's by the encoder delay (LAME: 576 + 529 samples)
# plus the padding that fills the last 1152-sample frame.
MP3_FRAME_SAMPLES = 1152
MP3_ENCODER_DELAY_SAMPLES = 1105


class ExportError(RuntimeError):
    """An output file could not be written (ffmpeg failed, bad input, unreadable result)."""


@contextmanager
def _atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path next to `path`; rename it to `path` on success, delete it on failure."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def to_pcm16(audio: torch.Tensor) -> np.ndarray:
    """[channels, N] float -> interleaved int16 [N, channels]; out-of-range samples are clipped."""
    samples = audio.detach().to("cpu", torch.float32).clamp(-1.0, 1.0).mul(32767.0).round()
    return samples.to(torch.int16).t().contiguous().numpy()


def write_wav(audio: torch.Tensor, path: str | os.PathLike, sample_rate: int) -> Path:
    """16-bit PCM WAV of float audio [channels, N] (the codec's is stereo) at `sample_rate`."""
    if audio.dim() != 2 or audio.shape[0] not in (1, 2) or audio.shape[1] < 1:
        raise ValueError(f"audio must be [1 or 2 channels, samples>=1], got {list(audio.shape)}")
    if not torch.isfinite(audio).all():
        raise ValueError("audio holds NaN or infinite samples")
    pcm = to_pcm16(audio)
    with _atomic_path(path) as tmp:
        with wave.open(str(tmp), "wb") as out:
            out.setnchannels(pcm.shape[1])
            out.setsampwidth(2)
            out.setframerate(sample_rate)
            out.writeframes(pcm.astype("<i2", copy=False).tobytes())
    return Path(path)


def _ffmpeg_missing() -> bool:
    return shutil.which(AudioSegment.converter) is None and not Path(AudioSegment.converter).is_file()


def probe_duration(path: str | os.PathLike) -> float:
    """Duration in seconds as ffprobe reports it; ExportError when ffprobe cannot read the file."""
    try:
        info = mediainfo_json(str(path))
        return float(info["format"]["duration"])
    except Exception as exc:  # pydub gives KeyError/ValueError/JSON errors for unreadable files
        raise ExportError(f"ffprobe cannot read {path}: {exc}") from exc


def write_mp3(wav_path: str | os.PathLike, mp3_path: str | os.PathLike, bitrate: str = "320k") -> Path:
    """Encode a WAV to MP3 with ffmpeg (through pydub) and check the result is a playable MP3 of the
    WAV's duration. pydub leaves an empty file when ffmpeg fails; here failure always raises."""
    if _ffmpeg_missing():
        raise ExportError(f"ffmpeg not found (pydub converter {AudioSegment.converter!r})")
    try:
        song = AudioSegment.from_wav(str(wav_path))
    except (OSError, CouldntDecodeError) as exc:
        raise ExportError(f"cannot read WAV {wav_path}: {exc}") from exc
    expected = song.frame_count() / song.frame_rate
    with _atomic_path(mp3_path) as tmp:
        try:
            song.export(str(tmp), format="mp3", bitrate=bitrate).close()
        except CouldntEncodeError as exc:
            raise ExportError(f"ffmpeg failed to encode {wav_path} to MP3 at {bitrate}: {exc}") from exc
        if tmp.stat().st_size == 0:
            raise ExportError(f"ffmpeg wrote an empty MP3 for {wav_path}")
        got = probe_duration(tmp)
        slack = (MP3_FRAME_SAMPLES + MP3_ENCODER_DELAY_SAMPLES) / song.frame_rate + 1e-3
        if not expected - 1e-3 <= got <= expected + slack:
            raise ExportError(f"MP3 of {wav_path} lasts {got:.3f} s, expected {expected:.3f} s")
    return Path(mp3_path)


def _json_default(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"metadata value of type {type(value).__name__} is not JSON serializable")


def write_metadata(path: str | os.PathLike, metadata: dict[str, Any]) -> Path:
    """Pretty UTF-8 JSON; paths become strings, other non-JSON values raise TypeError."""
    text = json.dumps(metadata, indent=2, ensure_ascii=False, default=_json_default)
    with _atomic_path(path) as tmp:
        tmp.write_text(text + "\n", encoding="utf-8")
    return Path(path)
