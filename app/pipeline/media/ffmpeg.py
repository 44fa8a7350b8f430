"""All ffmpeg/ffprobe work of the lip-sync pipeline: probing, audio extraction, frame decoding, encoding, mux.

Every external call runs with an argument list (no shell), a timeout after which the process is killed, and
its return code checked; failures raise `MediaError` carrying ffmpeg's last stderr lines, so a job record
says *why* a file was refused instead of a bare "returned non-zero exit status 1".

Frames are RGB uint8 arrays [height, width, 3] (see frames.py). The source video is decoded once into a
memory-mapped cache and is never looped or re-encoded before inference; only the final mux may loop the
*lip-synced picture* when it is shorter than the driving audio.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import IO, Any, Optional, Sequence, Union

import numpy as np

from app.pipeline.control import StageControl

PathLike = Union[str, os.PathLike]
FpsLike = Union[float, int, str, Fraction]

FFMPEG = os.environ.get("ENCORE_FFMPEG", "ffmpeg")
FFPROBE = os.environ.get("ENCORE_FFPROBE", "ffprobe")
ESPEAK = "espeak-ng"

PROBE_TIMEOUT_S = 30.0
EXTRACT_TIMEOUT_S = 300.0
DECODE_TIMEOUT_S = 3600.0
WRITER_STALL_TIMEOUT_S = 120.0   # one frame write may block this long before ffmpeg is presumed hung
WRITER_FINISH_TIMEOUT_S = 600.0  # flushing + moov rewrite (+faststart) after the last frame
HELPER_TIMEOUT_S = 120.0
STDERR_TAIL_LINES = 8
AAC_BITRATE = "192k"

_BASE = ["-nostdin", "-hide_banner", "-v", "error", "-y"]


class MediaError(RuntimeError):
    """A media file could not be read or written (ffmpeg/ffprobe failed, timed out, or gave nonsense)."""


# -- running processes ---------------------------------------------------------------------------------

def _tail(text: Union[str, bytes], lines: int = STDERR_TAIL_LINES) -> str:
    """Last lines of a tool's stderr: where ffmpeg states the actual error."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join(kept) if kept else "(no stderr)"


def _kill(proc: subprocess.Popen) -> None:
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


def _popen(argv: Sequence[str], what: str, **kwargs: Any) -> subprocess.Popen:
    """Start a streaming tool in its own session (so a kill takes the whole group)."""
    try:
        return subprocess.Popen(list(argv), start_new_session=True, **kwargs)
    except FileNotFoundError as exc:
        raise MediaError(f"{what}: {argv[0]} not found") from exc


def _run(argv: Sequence[str], *, timeout_s: float, what: str, stdin: Optional[bytes] = None) -> bytes:
    """Run a tool to completion; MediaError (with stderr tail) on non-zero exit, timeout or missing binary.

    Returns stdout. The child gets its own session so a timeout kill also takes any grandchildren."""
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except FileNotFoundError as exc:
        raise MediaError(f"{what}: {argv[0]} not found") from exc
    try:
        out, err = proc.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.communicate()
        raise MediaError(f"{what}: timed out after {timeout_s:g}s (killed {Path(argv[0]).name})") from None
    except BaseException:
        _kill(proc)
        raise
    if proc.returncode != 0:
        raise MediaError(f"{what}: {Path(argv[0]).name} exited with {proc.returncode}:\n{_tail(err)}")
    return out


class _Watchdog:
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
                _kill(self._proc)


def _read_tail(handle: IO[bytes]) -> str:
    handle.seek(0)
    return _tail(handle.read())


def _temp_sibling(path: Path) -> Path:
    """Temp name in the target folder, so the final rename is atomic and a failure never leaves `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.part{path.suffix}")


def _fps_arg(fps: FpsLike) -> str:
    """ffmpeg rate argument; float rates such as 29.97... become the exact 30000/1001."""
    if isinstance(fps, str):
        value = Fraction(fps)
    else:
        value = Fraction(fps).limit_denominator(1001)
    if value <= 0:
        raise ValueError(f"fps must be positive, got {fps!r}")
    return f"{value.numerator}/{value.denominator}"


# -- probing -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MediaInfo:
    """What ffprobe says about a file. width/height are the *displayed* size (rotation applied), which is
    what decode_frames yields; fps is avg_frame_rate (None when unknown, e.g. "0/0")."""

    duration_s: float
    has_video: bool
    has_audio: bool
    width: int = 0
    height: int = 0
    fps: Optional[float] = None
    frame_count: int = 0
    video_codec: Optional[str] = None
    audio_codec: Optional[str] = None
    rotation: int = 0
    audio_duration_s: Optional[float] = None
    video_duration_s: Optional[float] = None
    audio_sample_rate: Optional[int] = None
    audio_channels: Optional[int] = None
    fps_exact: Optional[str] = None  # avg_frame_rate as "num/den", for writers that must keep the exact rate


def effective_fps(info: MediaInfo, default: float = 25.0) -> float:
    """fps to use for a clip: its own, or `default` when ffprobe reports 0/unknown (seen on some uploads)."""
    return info.fps if info.fps and info.fps > 0 else default


def _ratio(text: Optional[str]) -> Optional[float]:
    if not text or text in ("0/0", "N/A"):
        return None
    try:
        value = float(Fraction(text))
    except (ValueError, ZeroDivisionError):
        return None
    return value if value > 0 and math.isfinite(value) else None


def _float(value: Any) -> Optional[float]:
    try:
        result = float(value)
    except (TypeError, ValueError):
        return None
    return result if math.isfinite(result) and result >= 0 else None


def _tag_duration(stream: dict) -> Optional[float]:
    """Matroska/WebM keep per-stream duration only as a "HH:MM:SS.fff" tag."""
    text = (stream.get("tags") or {}).get("DURATION")
    if not text:
        return None
    try:
        hours, minutes, seconds = text.split(":")
        return int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    except ValueError:
        return None


def _stream_duration(stream: Optional[dict]) -> Optional[float]:
    if stream is None:
        return None
    return _float(stream.get("duration")) or _tag_duration(stream)


def _rotation(stream: dict) -> int:
    """Clockwise display rotation in degrees (0/90/180/270) from the display matrix or the old rotate tag."""
    angle: Optional[float] = None
    for side in stream.get("side_data_list") or []:
        if "rotation" in side:
            angle = -float(side["rotation"])  # the matrix angle is counter-clockwise
            break
    if angle is None:
        try:
            angle = float((stream.get("tags") or {}).get("rotate") or 0)
        except ValueError:
            angle = 0.0
    return int(round(angle or 0)) % 360


def _count_frames(path: Path, timeout_s: float) -> Optional[int]:
    """Count video packets (no decoding) when the container does not store nb_frames (mkv, webm)."""
    out = _run([FFPROBE, "-v", "error", "-select_streams", "v:0", "-count_packets",
                "-show_entries", "stream=nb_read_packets", "-of", "json", str(path)],
               timeout_s=timeout_s, what=f"counting frames of {path}")
    streams = json.loads(out or b"{}").get("streams") or []
    return int(streams[0]["nb_read_packets"]) if streams and str(streams[0].get("nb_read_packets", "")).isdigit() \
        else None


def probe(path: PathLike, *, timeout_s: float = PROBE_TIMEOUT_S) -> MediaInfo:
    """Describe a media file; MediaError("… cannot be read as media") for anything ffprobe cannot parse."""
    path = Path(path)
    if not path.is_file():
        raise MediaError(f"{path} does not exist")
    try:
        out = _run([FFPROBE, "-v", "error", "-print_format", "json", "-show_format", "-show_streams", str(path)],
                   timeout_s=timeout_s, what=f"probing {path}")
        data = json.loads(out or b"{}")
    except (MediaError, ValueError) as exc:
        raise MediaError(f"{path.name} cannot be read as media: {exc}") from exc
    streams = data.get("streams") or []
    video = next((s for s in streams if s.get("codec_type") == "video"
                  and not (s.get("disposition") or {}).get("attached_pic")), None)  # cover art is no video
    audio = next((s for s in streams if s.get("codec_type") == "audio"), None)
    if video is None and audio is None:
        raise MediaError(f"{path.name} cannot be read as media: no audio or video stream")
    fmt = data.get("format") or {}
    video_duration = _stream_duration(video)
    audio_duration = _stream_duration(audio)
    duration = _float(fmt.get("duration")) or max(video_duration or 0.0, audio_duration or 0.0)
    info: dict[str, Any] = {}
    if video is not None:
        rotation = _rotation(video)
        width, height = int(video.get("width") or 0), int(video.get("height") or 0)
        if rotation in (90, 270):
            width, height = height, width
        fps = _ratio(video.get("avg_frame_rate"))
        frames = int(video["nb_frames"]) if str(video.get("nb_frames", "")).isdigit() else None
        if not frames:
            frames = _count_frames(path, timeout_s)
        if not frames and fps:
            frames = int(round((video_duration or duration) * fps))
        info.update(width=width, height=height, fps=fps, frame_count=frames or 0,
                    video_codec=video.get("codec_name"), rotation=rotation,
                    fps_exact=video.get("avg_frame_rate") if fps else None)
    if audio is not None:
        info.update(audio_codec=audio.get("codec_name"),
                    audio_sample_rate=int(audio["sample_rate"]) if audio.get("sample_rate") else None,
                    audio_channels=audio.get("channels"))
    return MediaInfo(duration_s=duration, has_video=video is not None, has_audio=audio is not None,
                     audio_duration_s=audio_duration if audio is not None else None,
                     video_duration_s=video_duration if video is not None else None, **info)


# -- audio ---------------------------------------------------------------------------------------------

def extract_audio(src: PathLike, dst_wav: PathLike, sample_rate: int = 16000, *,
                  timeout_s: float = EXTRACT_TIMEOUT_S) -> Path:
    """Mono 16-bit PCM WAV at `sample_rate` (16 kHz: what whisper's feature extractor expects) from the
    first audio stream of any container/codec. Written atomically."""
    src, dst = Path(src), Path(dst_wav)
    if not probe(src).has_audio:
        raise MediaError(f"{src.name} has no audio stream")
    tmp = _temp_sibling(dst)
    try:
        _run([FFMPEG, *_BASE, "-i", str(src), "-map", "0:a:0", "-vn", "-ac", "1", "-ar", str(sample_rate),
              "-c:a", "pcm_s16le", "-f", "wav", str(tmp)], timeout_s=timeout_s, what=f"extracting audio of {src}")
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


# -- decoding ------------------------------------------------------------------------------------------

class FrameCache:
    """Decoded frames in a raw memmap file on local disk: random access, RAM use of one frame at a time.

    Implements frames.FrameSequence. Items are copies, so they stay valid after close()."""

    def __init__(self, path: PathLike, count: int, height: int, width: int, fps: Optional[float] = None):
        self.path = Path(path)
        self.height, self.width, self.fps = height, width, fps
        self._count = count
        self._map: Optional[np.memmap] = np.memmap(self.path, dtype=np.uint8, mode="r",
                                                   shape=(count, height, width, 3))

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


def decode_frames(video: PathLike, cache_path: PathLike, *, control: Optional[StageControl] = None,
                  timeout_s: float = DECODE_TIMEOUT_S) -> FrameCache:
    """Decode every frame once (ffmpeg → rgb24 pipe, rotation applied by ffmpeg's autorotate) into
    `cache_path`. Frames are passed through as decoded (no fps conversion: no duplicates, no drops).
    Canceled/timeouts kill ffmpeg and remove the cache file."""
    video, cache = Path(video), Path(cache_path)
    info = probe(video)
    if not info.has_video or info.width <= 0 or info.height <= 0:
        raise MediaError(f"{video.name} has no video stream")
    frame_bytes = info.width * info.height * 3
    cache.parent.mkdir(parents=True, exist_ok=True)
    argv = [FFMPEG, *_BASE, "-i", str(video), "-map", "0:v:0", "-an", "-sn", "-dn", "-fps_mode", "passthrough",
            "-f", "rawvideo", "-pix_fmt", "rgb24", "pipe:1"]
    with tempfile.TemporaryFile() as errors:
        proc = _popen(argv, f"decoding {video.name}", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                      stderr=errors)
        watchdog = _Watchdog(proc)
        watchdog.arm(timeout_s)
        try:
            count = _pump_frames(proc, cache, frame_bytes, info.frame_count, control)
            rc = proc.wait()
        except BaseException:
            _kill(proc)
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
            failure = f"decoding {video.name}: ffmpeg exited with {rc}:\n{_read_tail(errors)}"
        elif count == 0:
            failure = f"decoding {video.name}: no frames decoded"
        if failure:
            cache.unlink(missing_ok=True)
            raise MediaError(failure)
    return FrameCache(cache, count, info.height, info.width, info.fps)


def _pump_frames(proc: subprocess.Popen, cache: Path, frame_bytes: int, expected: int,
                 control: Optional[StageControl]) -> int:
    """Copy whole frames from ffmpeg's stdout to the cache file through one reusable buffer."""
    buffer = bytearray(frame_bytes)
    view = memoryview(buffer)
    count = 0
    assert proc.stdout is not None
    with open(cache, "wb") as sink:
        while True:
            filled = 0
            while filled < frame_bytes:
                got = proc.stdout.readinto(view[filled:])
                if not got:
                    break
                filled += got
            if filled < frame_bytes:
                break  # EOF; a partial trailing frame only happens when ffmpeg was killed or failed
            sink.write(view)
            count += 1
            if control is not None:
                control.step(count, max(expected, count), "frames")
    return count


# -- encoding ------------------------------------------------------------------------------------------

_encoder_choice: Optional[str] = None
_encoder_lock = threading.Lock()


def pick_h264_encoder(*, refresh: bool = False) -> str:
    """"h264_nvenc" when a tiny test encode with it succeeds (driver + GPU present), else "libx264".

    Listing in `ffmpeg -encoders` is not enough: nvenc is compiled into this ffmpeg but fails without a
    driver. The answer is cached for the process."""
    global _encoder_choice
    with _encoder_lock:
        if _encoder_choice is None or refresh:
            try:
                # the exact settings the writer and the mux use, so a rejected option also means "no"
                _run([FFMPEG, *_BASE, "-f", "lavfi", "-i", "testsrc2=s=256x256:r=25", "-frames:v", "3",
                      *_h264_args("h264_nvenc"), "-f", "null", "-"], timeout_s=30, what="probing h264_nvenc")
                _encoder_choice = "h264_nvenc"
            except MediaError:
                _encoder_choice = "libx264"
        return _encoder_choice


def _h264_args(encoder: str) -> list[str]:
    """Visually transparent settings for a talking-head clip; speed-leaning presets.

    No B-frames (`-bf 0`): ffmpeg's `-t` cuts a stream copy by decode timestamps, so a picture with B-frames
    would keep its reorder delay (2 frames with x264's default) past the audio's end in the copy mux."""
    if encoder == "h264_nvenc":
        return ["-c:v", "h264_nvenc", "-preset", "p4", "-rc", "vbr", "-cq", "19", "-b:v", "0", "-bf", "0",
                "-pix_fmt", "yuv420p"]
    if encoder == "libx264":
        return ["-c:v", "libx264", "-preset", "veryfast", "-crf", "18", "-bf", "0", "-pix_fmt", "yuv420p"]
    return ["-c:v", encoder, "-bf", "0", "-pix_fmt", "yuv420p"]


class VideoWriter:
    """Frames (RGB uint8 [height, width, 3]) piped into ffmpeg → MP4, H.264 yuv420p, +faststart.

    Exactly one output frame per written frame (constant rate `fps`). The file appears at `path` only after
    ffmpeg exited 0; abort() (or an exception inside `with`) kills ffmpeg and removes the partial file.
    Odd sizes are cropped by one pixel row/column (yuv420p needs even sizes)."""

    def __init__(self, path: PathLike, *, width: int, height: int, fps: FpsLike, encoder: Optional[str] = None,
                 stall_timeout_s: float = WRITER_STALL_TIMEOUT_S, finish_timeout_s: float = WRITER_FINISH_TIMEOUT_S):
        if width <= 1 or height <= 1:
            raise ValueError(f"bad frame size {width}x{height}")
        self.path = Path(path)
        self.width, self.height = width, height
        self.rate = _fps_arg(fps)
        self.encoder = encoder or pick_h264_encoder()
        self.stall_timeout_s, self.finish_timeout_s = stall_timeout_s, finish_timeout_s
        self.frames_written = 0
        self._tmp = _temp_sibling(self.path)
        self._proc: Optional[subprocess.Popen] = None
        self._errors: Optional[IO[bytes]] = None
        self._watchdog: Optional[_Watchdog] = None

    def _argv(self) -> list[str]:
        even = [] if self.width % 2 == 0 and self.height % 2 == 0 else ["-vf", "crop=trunc(iw/2)*2:trunc(ih/2)*2:0:0"]
        return [FFMPEG, *_BASE, "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{self.width}x{self.height}",
                "-framerate", self.rate, "-i", "pipe:0", "-an", *even, *_h264_args(self.encoder),
                "-fps_mode", "passthrough", "-movflags", "+faststart", "-f", "mp4", str(self._tmp)]

    def open(self) -> "VideoWriter":
        if self._proc is not None:
            raise RuntimeError("writer already open")
        self._errors = tempfile.TemporaryFile()
        try:
            self._proc = _popen(self._argv(), f"writing {self.path.name}", stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=self._errors)
        except MediaError:
            self._errors.close()
            self._errors = None
            raise
        self._watchdog = _Watchdog(self._proc)
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
            self._proc.stdin.write(memoryview(np.ascontiguousarray(frame)).cast("B"))
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
            _kill(self._proc)
        self._cleanup()
        self._tmp.unlink(missing_ok=True)

    def _fail(self, message: str, cause: Optional[BaseException] = None) -> None:
        tail = _read_tail(self._errors) if self._errors else ""
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


# -- final mux -----------------------------------------------------------------------------------------

def mux_command(picture: PathLike, audio: PathLike, out: PathLike, *, audio_duration_s: float, loop: bool,
                encoder: str = "libx264") -> list[str]:
    """The ffmpeg command of the final mux. Picture only from input 0, sound only from input 1 (the driving
    audio) — never the source video's own track. Copy the picture when it covers the audio; loop and
    re-encode it only when it is shorter. Output is cut to the audio's duration."""
    duration = f"{audio_duration_s:.6f}"
    if loop:
        inputs = ["-stream_loop", "-1", "-i", str(picture), "-i", str(audio)]
        video = _h264_args(encoder)
    else:
        inputs = ["-i", str(picture), "-i", str(audio)]
        video = ["-c:v", "copy"]
    return [FFMPEG, *_BASE, *inputs, "-map", "0:v:0", "-map", "1:a:0", *video, "-c:a", "aac", "-b:a", AAC_BITRATE,
            "-t", duration, "-movflags", "+faststart", "-f", "mp4", str(out)]


def mux(picture: PathLike, audio: PathLike, out: PathLike, *, audio_duration_s: Optional[float] = None,
        picture_duration_s: Optional[float] = None, timeout_s: float, encoder: Optional[str] = None) -> Path:
    """Final MP4 = lip-synced picture + driving audio, duration == audio duration (± one frame).

    The picture "covers" the audio when it is at most one frame shorter (the lip-sync stage emits
    floor(audio × fps) frames): then the video is stream-copied. Otherwise it is looped and re-encoded.
    Durations are probed when not given. Written atomically; MediaError on failure or timeout."""
    picture, audio, out = Path(picture), Path(audio), Path(out)
    info = probe(picture)
    if not info.has_video:
        raise MediaError(f"{picture.name} has no video stream to mux")
    if audio_duration_s is None:
        audio_info = probe(audio)
        audio_duration_s = audio_info.audio_duration_s or audio_info.duration_s
    if picture_duration_s is None:
        picture_duration_s = info.video_duration_s or info.duration_s
    if not audio_duration_s or audio_duration_s <= 0:
        raise MediaError(f"{audio.name}: audio duration unknown or zero")
    frame_s = 1.0 / effective_fps(info)
    loop = picture_duration_s + frame_s + 1e-6 < audio_duration_s
    argv = mux_command(picture, audio, _temp_sibling(out), audio_duration_s=audio_duration_s, loop=loop,
                       encoder=(encoder or pick_h264_encoder()) if loop else "libx264")
    tmp = Path(argv[-1])
    try:
        _run(argv, timeout_s=timeout_s, what=f"muxing {picture.name} + {audio.name}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# -- test/demo material --------------------------------------------------------------------------------

def make_test_tone(path: PathLike, seconds: float, freq: float, sample_rate: int = 44100, *,
                   amplitude: float = 0.5, timeout_s: float = HELPER_TIMEOUT_S) -> Path:
    """A sine tone in whatever format the extension names (.wav, .mp3, .m4a ...)."""
    path = Path(path)
    source = f"aevalsrc={amplitude:g}*sin(2*PI*{freq:g}*t):s={sample_rate}:d={seconds:g}"
    _encode_to(path, ["-f", "lavfi", "-i", source], timeout_s, f"making tone {path.name}")
    return path


def make_speech(path: PathLike, text: str, *, timeout_s: float = HELPER_TIMEOUT_S) -> str:
    """Spoken `text` via espeak-ng; returns "espeak-ng", or "tone" when espeak-ng is missing/failed and a
    440 Hz tone of about the speech's length was written instead (callers/tests can tell which they got)."""
    path = Path(path)
    binary = shutil.which(ESPEAK)
    if binary:
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "speech.wav"
            try:
                # text on stdin: a text starting with "-" must never be read as an option
                _run([binary, "--stdin", "-w", str(raw)], stdin=text.encode("utf-8"), timeout_s=timeout_s,
                     what="espeak-ng")
                if raw.is_file() and raw.stat().st_size > 44:
                    _encode_to(path, ["-i", str(raw)], timeout_s, f"converting speech to {path.name}")
                    return "espeak-ng"
            except MediaError:
                pass
    make_test_tone(path, max(1.0, 0.075 * len(text)), 440.0, timeout_s=timeout_s)
    return "tone"


def make_face_video(path: PathLike, image_rgb: np.ndarray, seconds: float, fps: FpsLike, *, motion: bool = True,
                    audio: Optional[PathLike] = None, timeout_s: float = HELPER_TIMEOUT_S) -> Path:
    """H.264 MP4 of a still RGB image (odd sizes cropped to even). motion=True: a slow pan across the image
    enlarged by 8%, so consecutive frames differ as in real footage; motion=False: every frame is the image.
    `audio` (any file) is muxed in as the clip's own sound track, cut to the clip's length."""
    import cv2  # only the helpers need it

    path = Path(path)
    if image_rgb.ndim != 3 or image_rgb.shape[2] != 3 or image_rgb.dtype != np.uint8:
        raise ValueError("image must be uint8 [height, width, 3]")
    height, width = (image_rgb.shape[0] // 2) * 2, (image_rgb.shape[1] // 2) * 2
    frames = max(1, int(round(seconds * float(Fraction(_fps_arg(fps))))))
    if motion:
        pan = (f"scale=trunc(iw*1.08/2)*2:-2,"
               f"crop={width}:{height}:x='(iw-ow)/2*(1+sin(2*PI*t/{seconds:g}))':"
               f"y='(ih-oh)/2*(1+sin(2*PI*t/{seconds:g}+PI/3))'")
    else:
        pan = f"crop={width}:{height}:0:0"
    with tempfile.TemporaryDirectory() as tmp:
        still = Path(tmp) / "still.png"
        ok, png = cv2.imencode(".png", cv2.cvtColor(image_rgb, cv2.COLOR_RGB2BGR))
        if not ok:
            raise MediaError("could not encode the still image")
        still.write_bytes(png.tobytes())
        length = f"{frames / float(Fraction(_fps_arg(fps))):.6f}"
        inputs = ["-loop", "1", "-framerate", _fps_arg(fps), "-t", length, "-i", str(still)]
        maps = ["-map", "0:v:0"]
        if audio is not None:
            inputs += ["-i", str(audio)]
            maps += ["-map", "1:a:0", "-c:a", "aac", "-b:a", AAC_BITRATE]
        args = [*inputs, *maps, "-vf", pan, *_h264_args("libx264"), "-t", length, "-movflags", "+faststart"]
        _encode_to(path, args, timeout_s, f"making face video {path.name}")
    return path


def _encode_to(path: Path, args: list[str], timeout_s: float, what: str) -> None:
    """ffmpeg <args> → path (format from the extension), atomically."""
    tmp = _temp_sibling(path)
    try:
        _run([FFMPEG, *_BASE, *args, str(tmp)], timeout_s=timeout_s, what=what)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
