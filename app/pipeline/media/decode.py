"""Reading media out of files for the lip-sync stages: the driving audio as 16 kHz mono WAV, and every
frame of the source video decoded once into a memory-mapped cache on local disk.

Frames are RGB uint8 arrays [height, width, 3] (see app/pipeline/lipsync/frames.py). Decoding passes frames
through as they are (no fps conversion, so no duplicates or drops) and never loops the source video.
"""

from __future__ import annotations

import io
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, cast

import numpy as np

from app.pipeline.control import StageControl
from app.pipeline.media.ffmpeg import (
    BASE_ARGS,
    ON_PATH,
    MediaError,
    MediaTools,
    PathLike,
    Watchdog,
    exit_message,
    kill,
    popen,
    read_tail,
    run_to_file,
)
from app.pipeline.media.probe import MediaInfo, probe

EXTRACT_TIMEOUT_S = 300.0
DECODE_TIMEOUT_S = 3600.0


def extract_audio(
    src: PathLike,
    dst_wav: PathLike,
    sample_rate: int = 16000,
    *,
    timeout_s: float = EXTRACT_TIMEOUT_S,
    tools: MediaTools = ON_PATH,
) -> Path:
    """Mono 16-bit PCM WAV at `sample_rate` (16 kHz: what whisper's feature extractor expects) from the
    first audio stream of any container/codec. Written atomically."""
    src, dst = Path(src), Path(dst_wav)
    if not probe(src, tools=tools).has_audio:
        raise MediaError(f"{src.name} has no audio stream")
    return run_to_file(
        ["-i", str(src), "-map", "0:a:0", "-vn", "-ac", "1", "-ar", str(sample_rate), "-c:a", "pcm_s16le", "-f", "wav"],
        dst,
        timeout_s=timeout_s,
        what=f"extracting audio of {src}",
        tools=tools,
    )


class FrameCache:
    """Decoded frames in a raw memmap file on local disk: random access, RAM use of one frame at a time.

    Implements frames.FrameSequence. Items are copies, so they stay valid after close()."""

    def __init__(self, path: PathLike, count: int, height: int, width: int, fps: Optional[float] = None):
        self.path = Path(path)
        self.height, self.width, self.fps = height, width, fps
        self._count = count
        self._map: Optional[np.memmap] = np.memmap(self.path, dtype=np.uint8, mode="r", shape=(count, height, width, 3))

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> np.ndarray:
        if self._map is None:
            raise ValueError("frame cache is closed")
        i = int(index.__index__())
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(f"frame {index} out of range (0..{self._count - 1})")
        return np.array(self._map[i])

    def close(self) -> None:
        """Unmap the file (it stays on disk; the job's temp dir owns it)."""
        if self._map is not None:
            self._map._mmap.close()  # type: ignore[attr-defined]
            self._map = None

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "FrameCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decode_frames(
    video: PathLike,
    cache_path: PathLike,
    *,
    control: Optional[StageControl] = None,
    timeout_s: float = DECODE_TIMEOUT_S,
    tools: MediaTools = ON_PATH,
    max_frames: int | None = None,
    max_bytes: int | None = None,
    info: MediaInfo | None = None,
) -> FrameCache:
    """Decode every frame once (ffmpeg → rgb24 pipe, rotation applied by ffmpeg's autorotate) into
    `cache_path`. Frames are passed through as decoded (no fps conversion: no duplicates, no drops).
    Canceled/timeouts kill ffmpeg and remove the cache file. `max_frames`: only the first ones (what the output
    shows); `max_bytes`: the most the cache may take, checked on the frames really decoded (a MediaError saying
    so when the video would pass it), not on the header's frame count."""
    video, cache = Path(video), Path(cache_path)
    info = info or probe(video, tools=tools)  # `info`: the caller's probe of this same file
    if not info.has_video or info.width <= 0 or info.height <= 0:
        raise MediaError(f"{video.name} has no video stream")
    frame_bytes = info.width * info.height * 3
    cache.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        tools.ffmpeg,
        *BASE_ARGS,
        "-i",
        str(video),
        "-map",
        "0:v:0",
        "-an",
        "-sn",
        "-dn",
        "-fps_mode",
        "passthrough",
        *(["-frames:v", str(max_frames)] if max_frames is not None else []),
        "-f",
        "rawvideo",
        "-pix_fmt",
        "rgb24",
        "pipe:1",
    ]
    expected = (
        min(max_frames, info.frame_count)
        if max_frames is not None and info.frame_count
        else (max_frames or info.frame_count)
    )  # the header's count: for progress and an early refusal only
    if max_bytes is not None and expected * frame_bytes > max_bytes:
        raise MediaError(_too_big(video.name, expected, info.width, info.height, max_bytes))
    with tempfile.TemporaryFile() as errors:
        proc = popen(argv, f"decoding {video.name}", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors)
        watchdog = Watchdog(proc)
        watchdog.arm(timeout_s)
        try:
            count = _pump_frames(
                proc, cache, frame_bytes, expected, control, None if max_bytes is None else max_bytes // frame_bytes
            )
            rc = proc.wait()
        except BaseException:
            kill(proc)
            cache.unlink(missing_ok=True)
            raise
        finally:
            watchdog.stop()
            if proc.stdout:
                proc.stdout.close()
        failure = None
        if watchdog.fired:
            failure = f"decoding {video.name} timed out after {timeout_s:g}s"
        elif rc != 0:
            failure = exit_message(f"decoding {video.name}", argv[0], rc, read_tail(errors))
        elif count == 0:
            failure = f"decoding {video.name}: no frames decoded"
        if failure:
            cache.unlink(missing_ok=True)
            raise MediaError(failure)
    return FrameCache(cache, count, info.height, info.width, info.fps)


def _too_big(name: str, frames: int, width: int, height: int, max_bytes: int) -> str:
    return (
        f"decoding {name}: {frames} frames of {width}x{height} would take {frames * width * height * 3 / 2**20:.0f} "
        f"MiB of scratch, more than the {max_bytes / 2**20:.0f} MiB a job may use (ENCORE_MAX_SCRATCH_MB)"
    )


def _pump_frames(
    proc: subprocess.Popen,
    cache: Path,
    frame_bytes: int,
    expected: int,
    control: Optional[StageControl],
    most_frames: int | None = None,
) -> int:
    """Copy whole frames from ffmpeg's stdout to the cache file through one reusable buffer; MediaError past
    `most_frames` (the scratch bound), whatever the header promised."""
    buffer = bytearray(frame_bytes)
    view = memoryview(buffer)
    count = 0
    assert proc.stdout is not None
    stdout = cast(io.BufferedReader, proc.stdout)  # a binary pipe (no text=, default buffering)
    with open(cache, "wb") as sink:
        while True:
            filled = 0
            while filled < frame_bytes:
                got = stdout.readinto(view[filled:])
                if not got:
                    break
                filled += got
            if filled < frame_bytes:
                break  # EOF; a partial trailing frame only happens when ffmpeg was killed or failed
            if most_frames is not None and count >= most_frames:
                raise MediaError(
                    f"decoding past {most_frames} frames would pass the scratch a job may use (ENCORE_MAX_SCRATCH_MB)"
                )
            sink.write(view)
            count += 1
            if control is not None:
                control.step(count, max(expected, count), "frames")
    return count
