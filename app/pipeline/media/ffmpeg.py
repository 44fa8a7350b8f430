"""The one runner of ffmpeg/ffprobe for the whole project (lip-sync media and the music export alike).

Every external call runs with an argument list (no shell), a timeout after which the process is killed (with
its whole session), and its return code checked; failures raise `MediaError` naming what was being done and
the tool, with its last stderr lines, so a job record says *why* a file was refused instead of a bare
"returned non-zero exit status 1". The binaries are an argument (`MediaTools`) of every call that runs one:
the pipeline reads no settings; whoever runs it (the worker's stages, the web's upload probe, the demo) builds
its MediaTools once from its own settings (ENCORE_FFMPEG / ENCORE_FFPROBE) and passes it in.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import IO, Any, Optional, Protocol, Sequence, Union

PathLike = Union[str, os.PathLike]
FpsLike = Union[float, int, str, Fraction]

STDERR_TAIL_LINES = 8
BASE_ARGS = ["-nostdin", "-hide_banner", "-v", "error", "-y"]  # every ffmpeg call: quiet, never prompts


class NamesTheTools(Protocol):
    """Whatever names the two binaries (app/core/config.Settings does: ENCORE_FFMPEG, ENCORE_FFPROBE)."""

    @property
    def ffmpeg(self) -> str: ...
    @property
    def ffprobe(self) -> str: ...


@dataclass(frozen=True)
class MediaTools:
    """The ffmpeg and ffprobe binaries every media call runs (names looked up on PATH, or paths)."""

    ffmpeg: str = "ffmpeg"
    ffprobe: str = "ffprobe"

    @classmethod
    def of(cls, settings: NamesTheTools) -> "MediaTools":
        """The tools a settings object names; build it once per process and pass it down."""
        return cls(ffmpeg=settings.ffmpeg, ffprobe=settings.ffprobe)


ON_PATH = MediaTools()  # the default of every call: the tools on PATH


class MediaError(RuntimeError):
    """A media file could not be read or written (ffmpeg/ffprobe failed, timed out, or gave nonsense)."""


def tail(text: Union[str, bytes], lines: int = STDERR_TAIL_LINES) -> str:
    """Last lines of a tool's stderr: where ffmpeg states the actual error."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join(kept) if kept else "(no stderr)"


# The shapes of a failure message, shared by this runner, the frame decoder and the music export through
# pydub, so a job record reads the same way whichever of them failed.


def not_found_message(what: str, binary: str) -> str:
    return f"{what}: {binary} not found"


def exit_message(what: str, binary: str, returncode: int, stderr: Union[str, bytes]) -> str:
    return f"{what}: {Path(binary).name} exited with {returncode}:\n{tail(stderr)}"


def timeout_message(what: str, binary: str, timeout_s: float) -> str:
    return f"{what}: timed out after {timeout_s:g}s (killed {Path(binary).name})"


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process (own session, so its whole group) and reap it, so nothing is left behind."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                proc.kill()
            except ProcessLookupError:
                pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail to kill
        pass


def popen(argv: Sequence[str], what: str, **kwargs: Any) -> subprocess.Popen:
    """Start a streaming tool in its own session (so a kill takes the whole group)."""
    try:
        return subprocess.Popen(list(argv), start_new_session=True, **kwargs)
    except FileNotFoundError as exc:
        raise MediaError(not_found_message(what, argv[0])) from exc


def run(argv: Sequence[str], *, timeout_s: float, what: str, stdin: Optional[bytes] = None) -> bytes:
    """Run a tool to completion; MediaError (with stderr tail) on non-zero exit, timeout or missing binary.

    Returns stdout. The child gets its own session so a timeout kill also takes any grandchildren."""
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except FileNotFoundError as exc:
        raise MediaError(not_found_message(what, argv[0])) from exc
    try:
        out, err = proc.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill(proc)
        proc.communicate()
        raise MediaError(timeout_message(what, argv[0], timeout_s)) from None
    except BaseException:
        kill(proc)
        raise
    if proc.returncode != 0:
        raise MediaError(exit_message(what, argv[0], proc.returncode, err))
    return out


class Watchdog:
    """Kills a streaming process whose current step (whole decode, one frame write, the final flush) overruns.

    Streaming through pipes cannot use communicate(timeout=...), and a blocked read/write would hang forever;
    killing the process unblocks it (EOF / broken pipe) and `fired` tells the caller it was a timeout."""

    def __init__(self, proc: subprocess.Popen):
        self._proc = proc
        self._deadline: Optional[float] = None
        self._cond = threading.Condition()
        self._stopped = False
        self.fired = False
        self._thread = threading.Thread(target=self._watch, name="ffmpeg-watchdog", daemon=True)
        self._thread.start()

    def arm(self, seconds: Optional[float]) -> None:
        with self._cond:
            self._deadline = None if seconds is None else time.monotonic() + seconds
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(5)

    def _watch(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self.fired = True
                self._deadline = None
                kill(self._proc)


def run_to_file(args: Sequence[str], path: Path, *, timeout_s: float, what: str, tools: MediaTools = ON_PATH) -> Path:
    """ffmpeg <args> <path> (format from the extension), written atomically: `path` appears only on success."""
    tmp = temp_sibling(path)
    try:
        run([tools.ffmpeg, *BASE_ARGS, *args, str(tmp)], timeout_s=timeout_s, what=what)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_tail(handle: IO[bytes]) -> str:
    """The stderr tail of a streaming tool whose stderr went to a temporary file."""
    handle.seek(0)
    return tail(handle.read())


def temp_sibling(path: Path) -> Path:
    """Temp name in the target folder, so the final rename is atomic and a failure never leaves `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.part{path.suffix}")


def rate_arg(fps: FpsLike) -> str:
    """ffmpeg rate argument; float rates such as 29.97... become the exact 30000/1001."""
    if isinstance(fps, str):
        value = Fraction(fps)
    else:
        value = Fraction(fps).limit_denominator(1001)
    if value <= 0:
        raise ValueError(f"fps must be positive, got {fps!r}")
    return f"{value.numerator}/{value.denominator}"
