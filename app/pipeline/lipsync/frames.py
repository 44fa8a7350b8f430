"""Shared vocabulary of the lip-sync stages: how source frames are addressed and how output leaves.

Frames are RGB uint8 arrays [height, width, 3]. The source video is never looped or re-encoded before
inference: when the audio is longer than the video, output frame i shows source frame
`pingpong_index(i, n)` (forward, then backward, then forward ...), as MuseTalk does. When the output frame
rate differs from the source's, output frame i shows the source frame nearest in time (`source_frame`), so
head motion plays at its own speed.
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import numpy as np

FrameSink = Callable[[np.ndarray], None]  # receives output frames in order


class FrameSequence(Protocol):
    """Random access to decoded source frames (e.g. a memory-mapped cache on local disk)."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> np.ndarray: ...


def pingpong_index(i: int, n: int) -> int:
    """Source frame for output frame i when cycling n frames forward then backward (0,1,..,n-1,n-1,..,0,0,1..)."""
    if n <= 0:
        raise ValueError("no source frames")
    position = i % (2 * n)
    return position if position < n else 2 * n - 1 - position


def source_frame(i: int, n: int, source_fps: float | None = None, out_fps: float | None = None) -> int:
    """Source frame shown by output frame i: the one at source position floor(i x source_fps / out_fps)
    (the frame on screen at time i / out_fps of the source timeline), ping-ponged over the n frames.

    source_fps None: one source frame per output frame (pingpong_index(i, n)); equal rates give the same.
    The 1e-6 keeps exact products (29.97 over 29.97) from flooring one frame short.
    """
    if source_fps is None:
        return pingpong_index(i, n)
    if not (out_fps and out_fps > 0 and source_fps > 0):
        raise ValueError(f"frame rates must be positive (source {source_fps}, output {out_fps})")
    return pingpong_index(math.floor(i * source_fps / out_fps + 1e-6), n)


def source_frames_shown(num_frames: int, source_fps: float | None = None, out_fps: float | None = None) -> int:
    """How many leading source frames `num_frames` output frames can show: the highest source position they
    reach plus one. Decoding (and searching faces in) only these gives every output frame the source frame it
    would get from the whole video, since no position reaches past them (a source holding fewer ping-pongs over
    what it holds, as it would anyway): a 4 s output of a 10-minute clip reads 4 s of it."""
    if num_frames <= 0:
        return 0
    if source_fps is None:
        return num_frames
    if not (out_fps and out_fps > 0 and source_fps > 0):
        raise ValueError(f"frame rates must be positive (source {source_fps}, output {out_fps})")
    return math.floor((num_frames - 1) * source_fps / out_fps + 1e-6) + 1


DECODE_AT_LEAST = 256  # source frames the prepare stage decodes at the least (about 10 s at 25 fps)


def source_frames_to_decode(shown: int) -> int:
    """The leading source frames to decode for an output that shows `shown` of them: that many rounded up to a
    power of two (at least DECODE_AT_LEAST), so jobs of nearby lengths on one face video decode the same frames
    and share its cached faces (app/pipeline/lipsync/source_cache.py), while a short output of a long clip still
    reads at most twice what it shows. The caller takes the smaller of this and what the video holds."""
    return max(DECODE_AT_LEAST, 1 << max(shown - 1, 0).bit_length())


def shows_a_frame_twice(num_frames: int, n: int, source_fps: float | None = None, out_fps: float | None = None) -> bool:
    """Whether some source frame appears in more than one of the first num_frames output frames: then the
    model's per-frame work on it is worth keeping (cycling, or a source slower than the output)."""
    if num_frames > n:
        return True  # more output frames than source frames
    if source_fps is None or source_fps == out_fps:
        return False  # one for one, never past the last frame
    return len({source_frame(i, n, source_fps, out_fps) for i in range(num_frames)}) < num_frames


def output_frame_count(audio_seconds: float, fps: float) -> int:
    """MuseTalk's rule: floor(audio seconds x fps) output frames."""
    return int(audio_seconds * fps + 1e-9)
