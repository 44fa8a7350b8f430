"""MuseTalk v1.5 lip-sync: re-draw the lower face of each source frame to match the driving audio.

The procedure of public repo TMElyralab/MuseTalk (scripts/inference.py and the modules it calls):
  audio    whisper encoder over 30 s windows, ALL hidden states stacked per whisper frame (50/s); video
           frame i takes 2 * (left + 1 + right) whisper frames (10 for v1.5) starting at
           floor(i * 50 / fps) - ceil(50 / fps) * left, flattened time-major into a [10 * layers, d_model]
           prompt, plus a sinusoidal position table (musetalk/utils/audio_processor.py get_whisper_chunk,
           models/unet.py PositionalEncoding).
  face     256x256 crop of the face box (+ extra_margin below); VAE latents of the crop with its lower half
           blanked (-1 after normalisation) and of the whole crop, concatenated -> 8 channels
           (musetalk/models/vae.py get_latents_for_unet).
  UNet     one step at timestep 0; its output is a latent of the re-drawn crop; VAE decode.
  blend    resize back to the box and paste under a blurred mask (musetalk/utils/blending.py get_image). MuseTalk
           shapes the mask with a face-parsing network in its 'jaw' mode; those weights need a model hub, so
           `jaw_mask` draws the same region from the 68 landmarks instead (see there). Without landmarks
           (the Haar fallback) or with ENCORE_LIPSYNC_MASK=rectangle, the box's lower half (`mouth_mask`).

Output frame i shows source frame frames.source_frame(i, n, source fps, output fps): the source frame
nearest its time, cycled ping-pong when the audio is longer than the video. Memory stays flat in the number of output frames:
a few batches of frames live at a time and each finished frame goes straight to the sink. Per frame, only
the UNet step and the VAE decode are unavoidable; around them: source latents are encoded once per source
frame when the output cycles (SourceLatents), the blend and the sink run in a thread beside the next batch
(BlendWriter), and blend masks are cached per box size.
"""
from __future__ import annotations

import functools
import math
import queue
import threading
import wave
from pathlib import Path

import cv2
import numpy as np
import torch

from app.pipeline.control import StageControl
from app.pipeline.lipsync.faces import Box, crop_box
from app.pipeline.lipsync.frames import FrameSequence, FrameSink, shows_a_frame_twice, source_frame
from app.pipeline.lipsync.musetalk import (UNET_TIMESTEP, WHISPER_FEATURE_RATE, WHISPER_SAMPLE_RATE, WHISPER_WINDOW_S,
                       MuseTalkModels)

BLEND_EXPAND = 1.5       # blending.get_crop_box: the context square is 1.5x the face box's larger side
BLEND_BLUR_RATIO = 0.05  # blending.get_image: Gaussian kernel = 5% of the context square's width
PARSING_SIZE = 512       # MuseTalk parses the context square at 512x512; its kernels are in those pixels
MASK_CANVAS = 256        # the jaw mask is drawn at half that (kernels scaled to match)
CHEEK_HALF_WIDTH = 90    # face_parsing: outside centre +- 90 px (of 512) the skin is eroded (the cheeks)
JAW = list(range(0, 17))
BROWS_BACKWARDS = list(range(26, 16, -1))
NOSE = list(range(27, 36))
OUTER_LIPS = list(range(48, 60))


# -- audio ------------------------------------------------------------------------------------------------

def read_wav_16k(path: str | Path) -> np.ndarray:
    """Mono float32 samples in [-1, 1] from a 16 kHz PCM WAV (what `ffmpeg -ar 16000 -ac 1` writes)."""
    with wave.open(str(path), "rb") as wav:
        rate, channels, width = wav.getframerate(), wav.getnchannels(), wav.getsampwidth()
        raw = wav.readframes(wav.getnframes())
    if rate != WHISPER_SAMPLE_RATE:
        raise ValueError(f"{path}: expected {WHISPER_SAMPLE_RATE} Hz audio, got {rate} Hz")
    if width == 1:
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        dtype = np.int16 if width == 2 else np.int32
        samples = np.frombuffer(raw, dtype).astype(np.float32) / float(2 ** (8 * width - 1))
    else:
        raise ValueError(f"{path}: unsupported sample width {width} bytes")
    return samples.reshape(-1, channels).mean(axis=1)


@torch.inference_mode()
def whisper_hidden_states(models: MuseTalkModels, samples: np.ndarray) -> torch.Tensor:
    """[whisper frames, encoder_layers + 1, d_model] on the CPU: every hidden state of every 20 ms frame.

    Whisper only takes 30 s windows, so longer audio is encoded window by window and concatenated; the
    padding of the last window is trimmed to floor(seconds * 50) frames, as MuseTalk does.
    """
    if samples.size == 0:
        raise ValueError("audio is empty")
    window = WHISPER_WINDOW_S * WHISPER_SAMPLE_RATE
    parts = []
    for start in range(0, samples.size, window):
        mel = models.feature_extractor(samples[start:start + window], sampling_rate=WHISPER_SAMPLE_RATE,
                                       return_tensors="pt").input_features
        mel = mel.to(device=models.device, dtype=models.dtype)
        hidden = models.whisper(mel, output_hidden_states=True).hidden_states
        parts.append(torch.stack(hidden, dim=2)[0].cpu())  # [1500, layers, d_model]
    length = samples.size * WHISPER_FEATURE_RATE // WHISPER_SAMPLE_RATE
    return torch.cat(parts)[:length]


def window_features(hidden: torch.Tensor, *, fps: float, num_frames: int, padding_left: int,
                    padding_right: int) -> torch.Tensor:
    """[num_frames, 2 * (left + 1 + right) * layers, d_model] audio prompt per video frame.

    MuseTalk v1.5 (get_whisper_chunk): zero-pad ceil(50 / fps) * padding_left whisper frames in front, take
    2 * (left + 1 + right) frames starting at floor(i * 50 / fps) for video frame i, flatten (time, layer).
    Frames past the end of the audio see zeros, as MuseTalk's tail padding gives them.
    """
    if fps <= 0:
        raise ValueError("fps must be positive")
    per_frame = 2 * (padding_left + padding_right + 1)
    steps = WHISPER_FEATURE_RATE / fps
    starts = torch.tensor([math.floor(i * WHISPER_FEATURE_RATE / fps) for i in range(num_frames)],
                          dtype=torch.long)
    left = math.ceil(steps) * padding_left
    needed = int(starts.max()) + per_frame if num_frames else 0
    right = max(0, needed - left - hidden.shape[0])
    padded = torch.cat([hidden.new_zeros((left, *hidden.shape[1:])), hidden,
                        hidden.new_zeros((right, *hidden.shape[1:]))])
    index = starts[:, None] + torch.arange(per_frame)[None, :]
    windows = padded[index]  # [num_frames, per_frame, layers, d_model]
    return windows.reshape(num_frames, per_frame * hidden.shape[1], hidden.shape[2])


@torch.inference_mode()
def audio_features(models: MuseTalkModels, wav_16k_path: str | Path, *, fps: float, num_frames: int,
                   padding_left: int, padding_right: int) -> torch.Tensor:
    """Per-video-frame whisper prompts [num_frames, 2 * (left + 1 + right) * layers, d_model] (CPU, model dtype).

    Uses the real fps for the frame -> audio mapping (MuseTalk truncates it to an int, which drifts at 29.97).
    """
    hidden = whisper_hidden_states(models, read_wav_16k(wav_16k_path))
    return window_features(hidden, fps=fps, num_frames=num_frames, padding_left=padding_left,
                           padding_right=padding_right)


# -- faces -------------------------------------------------------------------------------------------------

def face_crop(frame: np.ndarray, box: Box, size: int) -> np.ndarray:
    """The box's pixels resized to size x size (Lanczos, as MuseTalk)."""
    x1, y1, x2, y2 = box
    return cv2.resize(np.ascontiguousarray(frame[y1:y2, x1:x2]), (size, size), interpolation=cv2.INTER_LANCZOS4)


def unet_latents(models: MuseTalkModels, crops: np.ndarray) -> torch.Tensor:
    """[B, 8, s/8, s/8]: latents of the crops with their lower half blanked, then of the whole crops.

    MuseTalk zeroes the lower half in [0, 1] before normalising to [-1, 1]; the latent is the posterior
    mode (MuseTalk's training code uses the mode; its inference samples, which only adds tiny noise).
    """
    pixels = torch.from_numpy(crops).to(models.device).permute(0, 3, 1, 2).to(models.dtype) / 255.0
    masked = pixels.clone()
    masked[:, :, pixels.shape[2] // 2:, :] = 0
    images = torch.cat([masked, pixels]) * 2.0 - 1.0
    latents = models.vae.encode(images).latent_dist.mode() * models.scaling_factor
    masked_latents, reference_latents = latents.chunk(2)
    return torch.cat([masked_latents, reference_latents], dim=1)


class SourceLatents:
    """UNet input latents per source frame. When the output cycles over the source (audio longer than the
    video: a short clip driven by a long speech), each source frame is VAE-encoded once and its latents kept
    on the model's device, instead of encoded again on every ping-pong pass."""

    def __init__(self, models: MuseTalkModels, *, keep: bool):
        self.models, self.keep = models, keep
        self._kept: dict[int, torch.Tensor] = {}
        self.encoded = 0  # source crops sent through the VAE encoder

    def __call__(self, sources: list[int], originals: list[np.ndarray], regions: list[Box]) -> torch.Tensor:
        """[B, 8, s/8, s/8] for output frames showing `sources` (their frames and face regions given)."""
        size = self.models.crop_size
        if not self.keep:
            self.encoded += len(sources)
            return unet_latents(self.models, np.stack([face_crop(f, r, size) for f, r in zip(originals, regions)]))
        todo = {s: (f, r) for s, f, r in zip(sources, originals, regions) if s not in self._kept}
        if todo:
            self.encoded += len(todo)
            latents = unet_latents(self.models, np.stack([face_crop(f, r, size) for f, r in todo.values()]))
            self._kept.update(zip(todo, latents))
        return torch.stack([self._kept[s] for s in sources])


def generate_faces(models: MuseTalkModels, latents: torch.Tensor, prompts: torch.Tensor) -> np.ndarray:
    """Re-drawn crops (uint8 [B, s, s, 3]) for UNet input latents [B, 8, s/8, s/8] (`unet_latents`) and
    audio prompts [B, seq, d_model]."""
    audio = prompts.to(device=models.device, dtype=models.dtype)
    audio = audio + models.positional_encoding(audio.shape[1])
    timestep = torch.tensor([UNET_TIMESTEP], device=models.device)
    predicted = models.unet(latents, timestep, encoder_hidden_states=audio).sample
    images = models.vae.decode(predicted / models.scaling_factor).sample
    images = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return images.permute(0, 2, 3, 1).cpu().numpy()


def _context_half_side(width: int, height: int) -> int:
    """Half the side of MuseTalk's context square around a box (blending.get_crop_box)."""
    return int(max(width, height) // 2 * BLEND_EXPAND)


def _blur_kernel(side: int) -> int:
    """MuseTalk's Gaussian kernel for a context square of `side` px (blending.get_image): odd, 5% of it."""
    return int(BLEND_BLUR_RATIO * side // 2 * 2) + 1


@functools.lru_cache(maxsize=256)
def mouth_mask(height: int, width: int) -> np.ndarray:
    """Blend weights [height, width, 1] over the face box: 1 on its lower half, fading to 0 at the edges.

    MuseTalk keeps the face mask below the middle of a 1.5x context square (the face box's centre row) and
    blurs it with a kernel of 5% of that square; here the region is inset by half a kernel so the blur
    reaches 0 at the box's edges instead of leaving a seam there. Cached per size (read-only: the face box
    barely changes between frames, the blur is the costliest part of the blend).
    """
    kernel = _blur_kernel(2 * _context_half_side(width, height))
    inset = kernel // 2
    mask = np.zeros((height, width), np.float32)
    mask[height // 2:height - inset, inset:width - inset] = 1.0
    if kernel > 1:
        mask = cv2.GaussianBlur(mask, (kernel, kernel), 0, borderType=cv2.BORDER_CONSTANT)
    mask = mask[:, :, None]
    mask.flags.writeable = False
    return mask


def _cone_kernel(scale: float) -> np.ndarray:
    """face_parsing's dilation kernel (a cone of 21 rows, its upper half empty, over a 12-row stem), scaled."""
    cone, tail = max(3, round(21 * scale)), max(1, round(12 * scale))
    size, centre = cone + tail, (cone + tail) // 2
    kernel = np.zeros((size, size), np.uint8)
    for row in range(cone // 2, cone):
        half = row - cone // 2
        kernel[row, max(0, centre - half):centre + half + 1] = 1
    base = int(kernel[cone - 1].sum())
    kernel[cone:, max(0, centre - base // 2):centre + base // 2 + 1] = 1
    return kernel


@functools.lru_cache(maxsize=1)
def _jaw_kernels() -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    scale = MASK_CANVAS / PARSING_SIZE
    cheek_kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (max(3, round(35 * scale) | 1), 3))
    cheeks = np.full((MASK_CANVAS, MASK_CANVAS), 255, np.uint8)
    half = round(CHEEK_HALF_WIDTH * scale)
    cheeks[:, MASK_CANVAS // 2 - half:MASK_CANVAS // 2 + half] = 0
    return _cone_kernel(scale), cheek_kernel, cheeks, _blur_kernel(MASK_CANVAS)


def jaw_mask(landmarks: np.ndarray, region: Box) -> np.ndarray:
    """Blend weights [height, width, 1] over the crop `region`, drawn from 68 landmarks the way MuseTalk's
    'jaw' parsing mode builds its mask (musetalk/utils/face_parsing): face skin (inside the jaw line and
    brows) grown by the cone kernel, eroded at the cheeks (outside the centre band), the nose left out, the
    lips and mouth put in; kept inside the region and below the context square's centre row (the region's
    centre row), blurred with a kernel of 5% of the square, as blending.get_image does."""
    x1, y1, x2, y2 = region
    width, height = x2 - x1, y2 - y1
    half_side = _context_half_side(width, height)
    left, top = (x1 + x2) // 2 - half_side, (y1 + y2) // 2 - half_side
    scale = MASK_CANVAS / (2 * half_side)
    points = np.round((landmarks - (left, top)) * scale).astype(np.int32)
    cone, cheek_kernel, cheeks, blur = _jaw_kernels()
    skin = np.zeros((MASK_CANVAS, MASK_CANVAS), np.uint8)
    cv2.fillPoly(skin, [points[JAW + BROWS_BACKWARDS]], 255)
    grown = cv2.dilate(skin, cone)
    eroded = cv2.erode(grown, cheek_kernel, iterations=2)
    mask = (eroded & cheeks) | (grown & ~cheeks)
    cv2.fillPoly(mask, [cv2.convexHull(points[NOSE])], 0)
    cv2.fillPoly(mask, [cv2.convexHull(points[OUTER_LIPS])], 255)
    inside = np.zeros_like(mask)
    rx1, ry1 = round((x1 - left) * scale), round((y1 - top) * scale)
    rx2, ry2 = round((x2 - left) * scale), round((y2 - top) * scale)
    top_row = max(ry1, MASK_CANVAS // 2)
    inside[top_row:ry2, rx1:rx2] = mask[top_row:ry2, rx1:rx2]
    blurred = cv2.GaussianBlur(inside, (blur, blur), 0).astype(np.float32) / 255.0
    patch = blurred[max(ry1, 0):ry2, max(rx1, 0):rx2]
    return cv2.resize(patch, (width, height), interpolation=cv2.INTER_LINEAR)[:, :, None]


def blend_mouth(frame: np.ndarray, face: np.ndarray, box: Box, mask: np.ndarray | None = None) -> np.ndarray:
    """A copy of `frame` with the re-drawn crop `face` pasted into `box` under `mask` [h, w, 1] (default:
    `mouth_mask`, the rectangle)."""
    x1, y1, x2, y2 = box
    height, width = y2 - y1, x2 - x1
    face = cv2.resize(face, (width, height)).astype(np.float32)
    out = np.array(frame, dtype=np.uint8, copy=True)
    region = out[y1:y2, x1:x2].astype(np.float32)
    weights = mouth_mask(height, width) if mask is None else mask
    out[y1:y2, x1:x2] = np.rint(region + (face - region) * weights).astype(np.uint8)
    return out


# -- the stage ---------------------------------------------------------------------------------------------

MAX_KEPT_SOURCE_FRAMES = 8192  # latents kept for ping-pong: 16 KB each in fp16 at MuseTalk's size


class BlendWriter:
    """Blends re-drawn faces into their frames and hands them to the sink in a background thread, in order,
    so that CPU work overlaps the model's work on the next batch. At most `depth` batches wait; an error in
    the sink is raised in the caller at its next `put` or at exit."""

    def __init__(self, sink: FrameSink, depth: int = 2):
        self.sink = sink
        self._batches: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lipsync-blend", daemon=True)

    def __enter__(self) -> "BlendWriter":
        self._thread.start()
        return self

    def put(self, originals: list[np.ndarray], faces: np.ndarray, regions: list[Box],
            landmarks: list[np.ndarray | None] | None = None) -> None:
        """Queue a batch; `landmarks` (per frame, or None for the rectangle mask) shape each frame's mask."""
        while True:
            self._raise_error()
            try:
                self._batches.put((originals, faces, regions, landmarks or [None] * len(regions)), timeout=0.1)
                return
            except queue.Full:
                continue

    def _run(self) -> None:
        while (batch := self._batches.get()) is not None:
            if self._error is not None:
                continue  # keep draining so `put` never blocks on a dead writer
            try:
                for frame, face, region, points in zip(*batch):
                    mask = None if points is None else jaw_mask(points, region)
                    self.sink(blend_mouth(frame, face, region, mask))
            except BaseException as error:  # handed to the caller's thread
                self._error = error

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def __exit__(self, exc_type, *_: object) -> None:
        self._batches.put(None)  # the writer always drains, so this returns
        self._thread.join()
        if exc_type is None:
            self._raise_error()


@torch.inference_mode()
def run_lipsync(models: MuseTalkModels, frames: FrameSequence, boxes: list[Box], features: torch.Tensor, *,
                num_frames: int, batch_size: int, extra_margin: int, sink: FrameSink,
                control: StageControl, fps: float | None = None, source_fps: float | None = None,
                landmarks: list[np.ndarray] | None = None) -> int:
    """Write `num_frames` lip-synced frames to `sink` in order; returns how many were written.

    `boxes` has one face box per source frame (gaps already filled); `features` comes from `audio_features`.
    `source_fps` (the source's frame rate, with `fps` the output's) resamples the source so each output
    frame shows the source frame nearest its time (`frames.source_frame`): a 30 fps clip driven at 25 fps
    keeps its head motion at its own speed. None: one source frame per output frame. With `landmarks` (one
    [68, 2] array per source frame) each frame blends through its `jaw_mask`, without them through the
    rectangle.
    Reports "done/total frames" after every batch and stops with `Canceled` when the job was canceled.
    """
    if len(boxes) != len(frames):
        raise ValueError(f"{len(boxes)} face boxes for {len(frames)} frames")
    if any(box is None for box in boxes):
        raise ValueError("every frame needs a face box (use faces.fill_missing)")
    if features.shape[0] < num_frames:
        raise ValueError(f"audio features cover {features.shape[0]} frames, {num_frames} requested")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    latents_of = SourceLatents(models, keep=shows_a_frame_twice(num_frames, len(frames), source_fps, fps)
                               and len(frames) <= MAX_KEPT_SOURCE_FRAMES)
    with BlendWriter(sink) as writer:
        for start in range(0, num_frames, batch_size):
            stop = min(start + batch_size, num_frames)
            sources = [source_frame(i, len(frames), source_fps, fps) for i in range(start, stop)]
            originals = [np.asarray(frames[s]) for s in sources]
            regions = [crop_box(boxes[s], frame.shape, extra_margin) for s, frame in zip(sources, originals)]
            writer.put(originals, generate_faces(models, latents_of(sources, originals, regions),
                                                 features[start:stop]), regions,
                       None if landmarks is None else [landmarks[s] for s in sources])
            control.step(stop, num_frames, "frames")
    if num_frames == 0:
        control.step(0, 0, "frames")
    return num_frames
