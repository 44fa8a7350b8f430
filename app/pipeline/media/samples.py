"""Synthetic clips for the demo and the tests: a sine tone, a spoken line (espeak-ng, or a tone where it is
missing), and a talking-head video made from a still image. Not used by the pipeline itself.
"""

from __future__ import annotations

import shutil
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Optional

import numpy as np

from app.pipeline.media.encode import AAC_BITRATE, h264_args
from app.pipeline.media.ffmpeg import ON_PATH, FpsLike, MediaError, MediaTools, PathLike, rate_arg, run, run_to_file

ESPEAK = "espeak-ng"
HELPER_TIMEOUT_S = 120.0


def make_test_tone(
    path: PathLike,
    seconds: float,
    freq: float,
    sample_rate: int = 44100,
    *,
    amplitude: float = 0.5,
    timeout_s: float = HELPER_TIMEOUT_S,
    tools: MediaTools = ON_PATH,
) -> Path:
    """A sine tone in whatever format the extension names (.wav, .mp3, .m4a ...)."""
    path = Path(path)
    source = f"aevalsrc={amplitude:g}*sin(2*PI*{freq:g}*t):s={sample_rate}:d={seconds:g}"
    run_to_file(["-f", "lavfi", "-i", source], path, timeout_s=timeout_s, what=f"making tone {path.name}", tools=tools)
    return path


def make_speech(path: PathLike, text: str, *, timeout_s: float = HELPER_TIMEOUT_S, tools: MediaTools = ON_PATH) -> str:
    """Spoken `text` via espeak-ng; returns "espeak-ng", or "tone" when espeak-ng is missing/failed and a
    440 Hz tone of about the speech's length was written instead (callers/tests can tell which they got)."""
    path = Path(path)
    binary = shutil.which(ESPEAK)
    if binary:
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "speech.wav"
            try:
                # text on stdin: a text starting with "-" must never be read as an option
                run(
                    [binary, "--stdin", "-w", str(raw)],
                    stdin=text.encode("utf-8"),
                    timeout_s=timeout_s,
                    what="espeak-ng",
                )
                if raw.is_file() and raw.stat().st_size > 44:
                    run_to_file(
                        ["-i", str(raw)],
                        path,
                        timeout_s=timeout_s,
                        what=f"converting speech to {path.name}",
                        tools=tools,
                    )
                    return "espeak-ng"
            except MediaError:
                pass
    make_test_tone(path, max(1.0, 0.075 * len(text)), 440.0, timeout_s=timeout_s, tools=tools)
    return "tone"


def make_face_video(
    path: PathLike,
    image_rgb: np.ndarray,
    seconds: float,
    fps: FpsLike,
    *,
    motion: bool = True,
    audio: Optional[PathLike] = None,
    timeout_s: float = HELPER_TIMEOUT_S,
    tools: MediaTools = ON_PATH,
) -> Path:
    """H.264 MP4 of a still RGB image (odd sizes cropped to even). motion=True: a slow pan across the image
    enlarged by 8%, so consecutive frames differ as in real footage; motion=False: every frame is the image.
    `audio` (any file) is muxed in as the clip's own sound track, cut to the clip's length."""
    import cv2  # only the helpers need it

    path = Path(path)
    if image_rgb.ndim != 3 or image_rgb.shape[2] != 3 or image_rgb.dtype != np.uint8:
        raise ValueError("image must be uint8 [height, width, 3]")
    height, width = (image_rgb.shape[0] // 2) * 2, (image_rgb.shape[1] // 2) * 2
    frames = max(1, int(round(seconds * float(Fraction(rate_arg(fps))))))
    if motion:
        pan = (
            f"scale=trunc(iw*1.08/2)*2:-2,"
            f"crop={width}:{height}:x='(iw-ow)/2*(1+sin(2*PI*t/{seconds:g}))':"
            f"y='(ih-oh)/2*(1+sin(2*PI*t/{seconds:g}+PI/3))'"
        )
    else:
        pan = f"crop={width}:{height}:0:0"
    with tempfile.TemporaryDirectory() as tmp:
        still = Path(tmp) / "still.png"
        ok, png = cv2.imencode(".png", cv2.cvtColor(image_rgb, cv2.COLOR_RGB2BGR))
        if not ok:
            raise MediaError("could not encode the still image")
        still.write_bytes(png.tobytes())
        length = f"{frames / float(Fraction(rate_arg(fps))):.6f}"
        inputs = ["-loop", "1", "-framerate", rate_arg(fps), "-t", length, "-i", str(still)]
        maps = ["-map", "0:v:0"]
        if audio is not None:
            inputs += ["-i", str(audio)]
            maps += ["-map", "1:a:0", "-c:a", "aac", "-b:a", AAC_BITRATE]
        args = [*inputs, *maps, "-vf", pan, *h264_args("libx264"), "-t", length, "-movflags", "+faststart"]
        run_to_file(args, path, timeout_s=timeout_s, what=f"making face video {path.name}", tools=tools)
    return path
