"""Shared vocabulary of the lip-sync stages: how source frames are addressed and how output leaves.

Frames are RGB uint8 arrays [height, width, 3]. The source video is never looped or re-encoded before
inference: when the audio is longer than the video, output frame i shows source frame
`pingpong_index(i, n)` (forward, then backward, then forward ...), as MuseTalk does.
"""
from __future__ import annotations

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


def output_frame_count(audio_seconds: float, fps: float) -> int:
    """MuseTalk's rule: floor(audio seconds x fps) output frames."""
    return int(audio_seconds * fps + 1e-9)
