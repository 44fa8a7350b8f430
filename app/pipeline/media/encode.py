"""Encoding the lip-synced picture: the H.264 encoder choice (NVENC when it works, else libx264) and the
frame writer that pipes RGB frames into ffmpeg and yields an MP4 only when ffmpeg succeeded.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import IO, Optional

import numpy as np

from app.pipeline.media.ffmpeg import (
    BASE_ARGS,
    ON_PATH,
    FpsLike,
    MediaError,
    MediaTools,
    PathLike,
    Watchdog,
    kill,
    popen,
    rate_arg,
    read_tail,
    run,
    temp_sibling,
)

WRITER_STALL_TIMEOUT_S = 120.0  # one frame write may block this long before ffmpeg is presumed hung
WRITER_FINISH_TIMEOUT_S = 600.0  # flushing + moov rewrite (+faststart) after the last frame
AAC_BITRATE = "192k"  # the sound of every MP4 written here (the final mux, the demo's clips)

_encoder_choice: dict[str, str] = {}  # per ffmpeg binary
_encoder_lock = threading.Lock()


def pick_h264_encoder(*, refresh: bool = False, tools: MediaTools = ON_PATH) -> str:
    """ "h264_nvenc" when a tiny test encode with it succeeds (driver + GPU present), else "libx264".

    Listing in `ffmpeg -encoders` is not enough: nvenc is compiled into this ffmpeg but fails without a
    driver. The answer is cached for the process (for each ffmpeg binary)."""
    with _encoder_lock:
        if tools.ffmpeg not in _encoder_choice or refresh:
            try:
                # the exact settings the writer and the mux use, so a rejected option also means "no"
                run(
                    [
                        tools.ffmpeg,
                        *BASE_ARGS,
                        "-f",
                        "lavfi",
                        "-i",
                        "testsrc2=s=256x256:r=25",
                        "-frames:v",
                        "3",
                        *h264_args("h264_nvenc"),
                        "-f",
                        "null",
                        "-",
                    ],
                    timeout_s=30,
                    what="probing h264_nvenc",
                )
                _encoder_choice[tools.ffmpeg] = "h264_nvenc"
            except MediaError:
                _encoder_choice[tools.ffmpeg] = "libx264"
        return _encoder_choice[tools.ffmpeg]


def h264_args(encoder: str) -> list[str]:
    """Visually transparent settings for a talking-head clip; speed-leaning presets.

    No B-frames (`-bf 0`): ffmpeg's `-t` cuts a stream copy by decode timestamps, so a picture with B-frames
    would keep its reorder delay (2 frames with x264's default) past the audio's end in the copy mux."""
    if encoder == "h264_nvenc":
        return [
            "-c:v",
            "h264_nvenc",
            "-preset",
            "p4",
            "-rc",
            "vbr",
            "-cq",
            "19",
            "-b:v",
            "0",
            "-bf",
            "0",
            "-pix_fmt",
            "yuv420p",
        ]
    if encoder == "libx264":
        return ["-c:v", "libx264", "-preset", "veryfast", "-crf", "18", "-bf", "0", "-pix_fmt", "yuv420p"]
    return ["-c:v", encoder, "-bf", "0", "-pix_fmt", "yuv420p"]


class VideoWriter:
    """Frames (RGB uint8 [height, width, 3]) piped into ffmpeg → MP4, H.264 yuv420p, +faststart.

    Exactly one output frame per written frame (constant rate `fps`). The file appears at `path` only after
    ffmpeg exited 0; abort() (or an exception inside `with`) kills ffmpeg and removes the partial file.
    Odd sizes are cropped by one pixel row/column (yuv420p needs even sizes)."""

    def __init__(
        self,
        path: PathLike,
        *,
        width: int,
        height: int,
        fps: FpsLike,
        encoder: Optional[str] = None,
        stall_timeout_s: float = WRITER_STALL_TIMEOUT_S,
        finish_timeout_s: float = WRITER_FINISH_TIMEOUT_S,
        tools: MediaTools = ON_PATH,
    ):
        if width <= 1 or height <= 1:
            raise ValueError(f"bad frame size {width}x{height}")
        self.path = Path(path)
        self.width, self.height = width, height
        self.rate = rate_arg(fps)
        self.tools = tools
        self.encoder = encoder or pick_h264_encoder(tools=tools)
        self.stall_timeout_s, self.finish_timeout_s = stall_timeout_s, finish_timeout_s
        self.frames_written = 0
        self._tmp = temp_sibling(self.path)
        self._proc: Optional[subprocess.Popen] = None
        self._errors: Optional[IO[bytes]] = None
        self._watchdog: Optional[Watchdog] = None

    def _argv(self) -> list[str]:
        even = [] if self.width % 2 == 0 and self.height % 2 == 0 else ["-vf", "crop=trunc(iw/2)*2:trunc(ih/2)*2:0:0"]
        return [
            self.tools.ffmpeg,
            *BASE_ARGS,
            "-f",
            "rawvideo",
            "-pix_fmt",
            "rgb24",
            "-s",
            f"{self.width}x{self.height}",
            "-framerate",
            self.rate,
            "-i",
            "pipe:0",
            "-an",
            *even,
            *h264_args(self.encoder),
            "-fps_mode",
            "passthrough",
            "-movflags",
            "+faststart",
            "-f",
            "mp4",
            str(self._tmp),
        ]

    def open(self) -> "VideoWriter":
        if self._proc is not None:
            raise RuntimeError("writer already open")
        self._errors = tempfile.TemporaryFile()
        try:
            self._proc = popen(
                self._argv(),
                f"writing {self.path.name}",
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=self._errors,
            )
        except MediaError:
            self._errors.close()
            self._errors = None
            raise
        self._watchdog = Watchdog(self._proc)
        return self

    def write(self, frame: np.ndarray) -> None:
        """Append one frame; MediaError if ffmpeg died or stalled longer than stall_timeout_s."""
        if self._proc is None or self._proc.stdin is None:
            raise RuntimeError("writer is not open")
        if frame.shape != (self.height, self.width, 3) or frame.dtype != np.uint8:
            raise ValueError(f"frame must be uint8 [{self.height}, {self.width}, 3], got {frame.dtype} {frame.shape}")
        watchdog = self._watchdog
        assert watchdog is not None
        watchdog.arm(self.stall_timeout_s)
        try:
            self._proc.stdin.write(np.ascontiguousarray(frame).data.cast("B"))
        except (BrokenPipeError, OSError, ValueError) as exc:
            self._fail(f"ffmpeg stopped taking frames after {self.frames_written}", exc)
        finally:
            watchdog.arm(None)
        self.frames_written += 1

    __call__ = write  # a VideoWriter is a frames.FrameSink

    def close(self) -> Path:
        """Finish the file: flush, wait for ffmpeg (rc checked), move into place."""
        if self._proc is None:
            raise RuntimeError("writer is not open")
        if self.frames_written == 0:
            self.abort()
            raise MediaError(f"no frames written to {self.path.name}")
        assert self._watchdog is not None and self._proc.stdin is not None
        self._watchdog.arm(self.finish_timeout_s)
        try:
            self._proc.stdin.close()
        except OSError:
            pass  # reported through the return code below
        rc = self._proc.wait()
        if self._watchdog.fired:
            self._fail(f"finishing timed out after {self.finish_timeout_s:g}s")
        if rc != 0:
            self._fail(f"ffmpeg exited with {rc}")
        os.replace(self._tmp, self.path)
        self._cleanup()
        return self.path

    def abort(self) -> None:
        """Stop now (cancel or failure upstream): kill ffmpeg, remove the partial file. Safe to repeat."""
        if self._proc is not None:
            if self._proc.stdin is not None:
                try:
                    self._proc.stdin.close()
                except OSError:
                    pass
            kill(self._proc)
        self._cleanup()
        self._tmp.unlink(missing_ok=True)

    def _fail(self, message: str, cause: Optional[BaseException] = None) -> None:
        tail = read_tail(self._errors) if self._errors else ""
        timed_out = bool(self._watchdog and self._watchdog.fired)
        self.abort()
        suffix = f" (stalled > {self.stall_timeout_s:g}s, killed)" if timed_out and "timed out" not in message else ""
        raise MediaError(f"writing {self.path.name}: {message}{suffix}:\n{tail}") from cause

    def _cleanup(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._errors is not None:
            self._errors.close()
            self._errors = None
        self._proc = None

    def __enter__(self) -> "VideoWriter":
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._proc is not None:
            self.close()
