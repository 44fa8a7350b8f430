"""Writing a decoded song to disk: 16-bit stereo WAV, MP3 via pydub/ffmpeg, JSON metadata.

Every writer goes through a temporary file in the target folder and renames it into place, so a failed or
interrupted export never leaves a truncated or empty file under the final name, nor anything outside it. The MP3
encode runs the ffmpeg of the `MediaTools` it is given (the worker's: ENCORE_FFMPEG) through Encore's runner, so
its failures read like every other ffmpeg failure (app/pipeline/media/ffmpeg.py): what was being done, the tool,
its exit code and the tail of its stderr.
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
    from pydub.exceptions import CouldntDecodeError

from app.pipeline.media.ffmpeg import ON_PATH, MediaError, MediaTools, not_found_message, run
from app.pipeline.media.probe import probe

# ffprobe's duration of an MP3 may exceed the audio's by the encoder delay (LAME: 576 + 529 samples)
# plus the padding that fills the last 1152-sample frame.
MP3_FRAME_SAMPLES = 1152
MP3_ENCODER_DELAY_SAMPLES = 1105


class ExportError(MediaError):
    """An output file could not be written (ffmpeg failed, bad input, unreadable result). A MediaError, like
    every failure of an ffmpeg call, so callers and job records treat both pipelines' media errors alike."""


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


def probe_duration(path: str | os.PathLike, *, tools: MediaTools = ON_PATH) -> float:
    """Duration in seconds as `tools`' ffprobe reports it; ExportError when it cannot read the file."""
    try:
        return probe(path, tools=tools).duration_s
    except MediaError as exc:
        raise ExportError(str(exc)) from exc


MP3_TIMEOUT_S = 600.0  # an encode of the longest song takes seconds; this only stops a hung ffmpeg


def write_mp3(
    wav_path: str | os.PathLike,
    mp3_path: str | os.PathLike,
    bitrate: str = "320k",
    *,
    tools: MediaTools = ON_PATH,
    timeout_s: float = MP3_TIMEOUT_S,
) -> Path:
    """Encode a WAV to MP3 with `tools`' ffmpeg and check the result is a playable MP3 of the WAV's duration.
    ffmpeg runs through Encore's runner (app/pipeline/media/ffmpeg.run: its timeout, its error shape) and writes
    next to the final file: pydub's own export would first copy the song to a temporary WAV in $TMPDIR and leave
    it there whenever ffmpeg failed or the stage was killed (~32 MB per 3-minute song), out of reach of Encore's
    sweeps. pydub still reads the WAV (its length is what the MP3 must last)."""
    ffmpeg = tools.ffmpeg
    what = f"encoding {Path(wav_path).name} to MP3 at {bitrate}"
    if shutil.which(ffmpeg) is None:
        raise ExportError(not_found_message(what, ffmpeg))
    try:
        song = AudioSegment.from_wav(str(wav_path))
    except (OSError, CouldntDecodeError) as exc:
        raise ExportError(f"cannot read WAV {wav_path}: {exc}") from exc
    expected = song.frame_count() / song.frame_rate
    with _atomic_path(mp3_path) as tmp:
        argv = [ffmpeg, "-nostdin", "-v", "error", "-y", "-i", str(wav_path), "-vn", "-codec:a", "libmp3lame"]
        try:
            run([*argv, "-b:a", bitrate, "-f", "mp3", str(tmp)], timeout_s=timeout_s, what=what)
        except MediaError as exc:
            raise ExportError(str(exc)) from exc
        if not tmp.exists() or tmp.stat().st_size == 0:
            raise ExportError(f"{what}: ffmpeg wrote an empty MP3")
        got = probe_duration(tmp, tools=tools)
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
