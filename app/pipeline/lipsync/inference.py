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
from typing import Any, Callable, Generator, Iterable, Iterator

import cv2
import numpy as np
import torch

from app.pipeline.control import StageControl
from app.pipeline.lipsync.faces import Box, crop_box
from app.pipeline.lipsync.frames import FrameSequence, FrameSink, shows_a_frame_twice, source_frame
from app.pipeline.lipsync.options import LIPSYNC_PATHS
from app.pipeline.lipsync.musetalk import (
    UNET_TIMESTEP,
    WHISPER_FEATURE_RATE,
    WHISPER_SAMPLE_RATE,
    WHISPER_WINDOW_S,
    MuseTalkModels,
)

BLEND_EXPAND = 1.5  # blending.get_crop_box: the context square is 1.5x the face box's larger side
BLEND_BLUR_RATIO = 0.05  # blending.get_image: Gaussian kernel = 5% of the context square's width
PARSING_SIZE = 512  # MuseTalk parses the context square at 512x512; its kernels are in those pixels
MASK_CANVAS = 256  # the jaw mask is drawn at half that (kernels scaled to match)
CHEEK_HALF_WIDTH = 90  # face_parsing: outside centre +- 90 px (of 512) the skin is eroded (the cheeks)
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


WHISPER_WINDOWS_PER_PASS = 8  # 30 s windows encoded together (4 minutes of audio per forward)


@torch.inference_mode()
def whisper_hidden_states(models: MuseTalkModels, samples: np.ndarray) -> torch.Tensor:
    """[whisper frames, encoder_layers + 1, d_model] on the model's device: every hidden state of every
    20 ms frame.

    Whisper only takes 30 s windows, so the audio is cut into windows, encoded WHISPER_WINDOWS_PER_PASS at
    a time as one batch, and concatenated; the padding of the last window is trimmed to
    floor(seconds * 50) frames, as MuseTalk does.
    """
    if samples.size == 0:
        raise ValueError("audio is empty")
    window = WHISPER_WINDOW_S * WHISPER_SAMPLE_RATE
    pieces = [samples[start : start + window] for start in range(0, samples.size, window)]
    parts = []
    for first in range(0, len(pieces), WHISPER_WINDOWS_PER_PASS):
        mel = models.feature_extractor(
            pieces[first : first + WHISPER_WINDOWS_PER_PASS], sampling_rate=WHISPER_SAMPLE_RATE, return_tensors="pt"
        ).input_features
        mel = mel.to(device=models.device, dtype=models.dtype)
        hidden = models.whisper(mel, output_hidden_states=True).hidden_states
        parts.append(torch.stack(hidden, dim=2).flatten(0, 1))  # [windows * 1500, layers, d_model]
    length = samples.size * WHISPER_FEATURE_RATE // WHISPER_SAMPLE_RATE
    return torch.cat(parts)[:length]


def _window_starts(fps: float, num_frames: int) -> torch.Tensor:
    if fps <= 0:
        raise ValueError("fps must be positive")
    return torch.tensor([math.floor(i * WHISPER_FEATURE_RATE / fps) for i in range(num_frames)], dtype=torch.long)


def window_features(
    hidden: torch.Tensor, *, fps: float, num_frames: int, padding_left: int, padding_right: int
) -> torch.Tensor:
    """[num_frames, 2 * (left + 1 + right) * layers, d_model] audio prompt per video frame.

    MuseTalk v1.5 (get_whisper_chunk): zero-pad ceil(50 / fps) * padding_left whisper frames in front, take
    2 * (left + 1 + right) frames starting at floor(i * 50 / fps) for video frame i, flatten (time, layer).
    Frames past the end of the audio see zeros, as MuseTalk's tail padding gives them. The reference for
    AudioWindows, which builds the same prompts batch by batch.
    """
    return AudioWindows(hidden, fps=fps, num_frames=num_frames, padding_left=padding_left, padding_right=padding_right)[
        0:num_frames
    ]


class AudioWindows:
    """The prompts of `window_features`, built for a slice of frames at a time from the hidden states
    (kept once, on their device): memory stays that of the hidden states, not 2 * (left + 1 + right) times it."""

    def __init__(self, hidden: torch.Tensor, *, fps: float, num_frames: int, padding_left: int, padding_right: int):
        self.per_frame = 2 * (padding_left + padding_right + 1)
        self.starts = _window_starts(fps, num_frames).to(hidden.device)
        self.num_frames = num_frames
        left = math.ceil(WHISPER_FEATURE_RATE / fps) * padding_left
        needed = int(self.starts.max()) + self.per_frame if num_frames else 0
        right = max(0, needed - left - hidden.shape[0])
        self.padded = torch.cat(
            [hidden.new_zeros((left, *hidden.shape[1:])), hidden, hidden.new_zeros((right, *hidden.shape[1:]))]
        )
        self.offsets = torch.arange(self.per_frame, device=hidden.device)

    def __len__(self) -> int:
        return self.num_frames

    def __getitem__(self, frames: slice) -> torch.Tensor:
        """[frames, per_frame * layers, d_model] for a slice of video frames."""
        index = self.starts[frames][:, None] + self.offsets[None, :]
        windows = self.padded[index]  # [frames, per_frame, layers, d_model]
        return windows.reshape(windows.shape[0], self.per_frame * self.padded.shape[1], self.padded.shape[2])


@torch.inference_mode()
def audio_windows(
    models: MuseTalkModels,
    wav_16k_path: str | Path,
    *,
    fps: float,
    num_frames: int,
    padding_left: int,
    padding_right: int,
) -> AudioWindows:
    """Per-video-frame whisper prompts of a 16 kHz WAV, sliced per batch (on the model's device).

    Uses the real fps for the frame -> audio mapping (MuseTalk truncates it to an int, which drifts at 29.97).
    """
    hidden = whisper_hidden_states(models, read_wav_16k(wav_16k_path))
    return AudioWindows(hidden, fps=fps, num_frames=num_frames, padding_left=padding_left, padding_right=padding_right)


def audio_features(
    models: MuseTalkModels,
    wav_16k_path: str | Path,
    *,
    fps: float,
    num_frames: int,
    padding_left: int,
    padding_right: int,
) -> torch.Tensor:
    """Every prompt of `audio_windows` at once: [num_frames, 2 * (left + 1 + right) * layers, d_model]."""
    windows = audio_windows(
        models, wav_16k_path, fps=fps, num_frames=num_frames, padding_left=padding_left, padding_right=padding_right
    )
    return windows[0:num_frames]


# -- faces -------------------------------------------------------------------------------------------------


def face_crop(frame: np.ndarray, box: Box, size: int) -> np.ndarray:
    """The box's pixels resized to size x size (Lanczos, as MuseTalk)."""
    x1, y1, x2, y2 = box
    return cv2.resize(np.ascontiguousarray(frame[y1:y2, x1:x2]), (size, size), interpolation=cv2.INTER_LANCZOS4)


def device_crops(frames: torch.Tensor, regions: list[Box], size: int) -> torch.Tensor:
    """[B, 3, size, size] float in [0, 1]: each frame's region of `frames` (uint8 [B, H, W, 3], on any
    device) resized on that device. Bicubic with antialiasing stands in for OpenCV's Lanczos (torch has no
    Lanczos); the parity test bounds what that changes."""
    crops = []
    for frame, (x1, y1, x2, y2) in zip(frames, regions, strict=True):
        pixels = frame[y1:y2, x1:x2].permute(2, 0, 1)[None].float()
        crops.append(
            torch.nn.functional.interpolate(
                pixels, size=(size, size), mode="bicubic", antialias=True, align_corners=False
            )
        )
    return torch.cat(crops).clamp_(0, 255) / 255.0


def encode_pixels(models: MuseTalkModels, pixels: torch.Tensor) -> torch.Tensor:
    """[B, 8, s/8, s/8] UNet input latents of face crops `pixels` ([B, 3, s, s] in [0, 1]): the latents of
    the crops with their lower half blanked, then of the whole crops.

    MuseTalk zeroes the lower half in [0, 1] before normalising to [-1, 1]; the latent is the posterior
    mode (MuseTalk's training code uses the mode; its inference samples, which only adds tiny noise).
    """
    pixels = pixels.to(device=models.device, dtype=models.dtype)
    masked = pixels.clone()
    masked[:, :, pixels.shape[2] // 2 :, :] = 0
    images = torch.cat([masked, pixels]) * 2.0 - 1.0
    latents = models.vae.encode(images).latent_dist.mode() * models.scaling_factor
    masked_latents, reference_latents = latents.chunk(2)
    return torch.cat([masked_latents, reference_latents], dim=1)


def unet_latents(models: MuseTalkModels, crops: np.ndarray) -> torch.Tensor:
    """`encode_pixels` of uint8 crops [B, s, s, 3] (the reference path's, from `face_crop`)."""
    return encode_pixels(models, torch.from_numpy(crops).permute(0, 3, 1, 2).float() / 255.0)


PixelsOf = Callable[[list[int]], torch.Tensor]  # positions within a batch -> their crops [k, 3, s, s] in [0, 1]


class SourceLatents:
    """UNet input latents per source frame. When the output cycles over the source (audio longer than the
    video: a short clip driven by a long speech), each source frame is VAE-encoded once and its latents kept
    on the model's device, instead of encoded again on every ping-pong pass. `kept` starts it with latents
    from the source cache (source_cache.py); with `keep` the latents of every frame seen are kept, for
    reuse and for the cache."""

    def __init__(self, models: MuseTalkModels, *, keep: bool, kept: dict[int, torch.Tensor] | None = None):
        self.models, self.keep = models, keep
        self.kept: dict[int, torch.Tensor] = {i: t.to(models.device, models.dtype) for i, t in (kept or {}).items()}
        self.encoded = 0  # source crops sent through the VAE encoder

    def get(self, sources: list[int], pixels_of: PixelsOf) -> torch.Tensor:
        """[B, 8, s/8, s/8] for output frames showing `sources`; `pixels_of` crops the ones to encode."""
        if not self.keep:
            self.encoded += len(sources)
            return encode_pixels(self.models, pixels_of(list(range(len(sources)))))
        todo: dict[int, int] = {}  # source frame -> its first position in the batch
        for position, source in enumerate(sources):
            if source not in self.kept:
                todo.setdefault(source, position)
        if todo:
            self.encoded += len(todo)
            self.kept.update(zip(todo, encode_pixels(self.models, pixels_of(list(todo.values()))), strict=True))
        return torch.stack([self.kept[s] for s in sources])

    def __call__(self, sources: list[int], originals: list[np.ndarray], regions: list[Box]) -> torch.Tensor:
        """`get` with the reference crops (OpenCV Lanczos on the CPU) of `originals` at `regions`."""
        size = self.models.crop_size
        return self.get(
            sources,
            lambda positions: (
                torch.from_numpy(np.stack([face_crop(originals[p], regions[p], size) for p in positions]))
                .permute(0, 3, 1, 2)
                .float()
                / 255.0
            ),
        )


def redraw_faces(
    models: MuseTalkModels, latents: torch.Tensor, prompts: torch.Tensor, *, pad_to: int = 0
) -> torch.Tensor:
    """Re-drawn crops, uint8 [B, 3, s, s] on the model's device, for UNet input latents [B, 8, s/8, s/8]
    (`encode_pixels`) and audio prompts [B, seq, d_model]. A batch smaller than `pad_to` is padded with
    copies of its last item (dropped again): every call then has the same shapes, so the last partial batch
    of a clip reuses the kernels (and cuDNN's choices) of the others."""
    count = latents.shape[0]
    if count < pad_to:
        latents = torch.cat([latents, latents[-1:].expand(pad_to - count, *latents.shape[1:])])
        prompts = torch.cat([prompts, prompts[-1:].expand(pad_to - count, *prompts.shape[1:])])
    audio = prompts.to(device=models.device, dtype=models.dtype)
    audio = audio + models.positional_encoding(audio.shape[1])
    timestep = torch.tensor([UNET_TIMESTEP], device=models.device)
    predicted = models.unet(latents, timestep, encoder_hidden_states=audio).sample
    images = models.vae.decode(predicted / models.scaling_factor).sample[:count]
    return ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)


def generate_faces(models: MuseTalkModels, latents: torch.Tensor, prompts: torch.Tensor) -> np.ndarray:
    """`redraw_faces` as uint8 [B, s, s, 3] on the CPU (the reference path blends there)."""
    return redraw_faces(models, latents, prompts).permute(0, 2, 3, 1).cpu().numpy()


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
    mask: np.ndarray = np.zeros((height, width), np.float32)
    mask[height // 2 : height - inset, inset : width - inset] = 1.0
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
        kernel[row, max(0, centre - half) : centre + half + 1] = 1
    base = int(kernel[cone - 1].sum())
    kernel[cone:, max(0, centre - base // 2) : centre + base // 2 + 1] = 1
    return kernel


@functools.lru_cache(maxsize=1)
def _jaw_kernels() -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    scale = MASK_CANVAS / PARSING_SIZE
    cheek_kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (max(3, round(35 * scale) | 1), 3))
    cheeks = np.full((MASK_CANVAS, MASK_CANVAS), 255, np.uint8)
    half = round(CHEEK_HALF_WIDTH * scale)
    cheeks[:, MASK_CANVAS // 2 - half : MASK_CANVAS // 2 + half] = 0
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
    patch = blurred[max(ry1, 0) : ry2, max(rx1, 0) : rx2]
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


def blend_on_device(
    frames: torch.Tensor, faces: torch.Tensor, regions: list[Box], masks: list[np.ndarray]
) -> torch.Tensor:
    """`blend_mouth` as tensor ops on the frames' device, in place: frames uint8 [B, H, W, 3], re-drawn
    crops uint8 [B, 3, s, s] (on that device), each pasted into its region under its mask [h, w, 1]."""
    for frame, face, (x1, y1, x2, y2), mask in zip(frames, faces, regions, masks, strict=True):
        height, width = y2 - y1, x2 - x1
        resized = torch.nn.functional.interpolate(
            face[None].float(), size=(height, width), mode="bilinear", align_corners=False
        )[0].permute(1, 2, 0)
        weights = torch.tensor(mask, device=frames.device)  # a copy: cached masks are read-only arrays
        region = frame[y1:y2, x1:x2].float()
        frame[y1:y2, x1:x2] = torch.round(region + (resized.round().clamp_(0, 255) - region) * weights).to(torch.uint8)
    return frames


# -- the stage ---------------------------------------------------------------------------------------------

MAX_KEPT_SOURCE_FRAMES = 8192  # latents kept for ping-pong: 16 KB each in fp16 at MuseTalk's size


class FrameWriter:
    """Finishes batches and hands their frames to the sink in a background thread, in order, so that the
    CPU's share (the reference path's blend; the device path's wait for its copy back) and the encoder's
    pipe overlap the model's work on the next batch. A batch is a callable returning its frames. At most
    `depth` batches wait; an error in the sink is raised in the caller at its next `put` or at exit."""

    def __init__(self, sink: FrameSink, depth: int = 2):
        self.sink = sink
        self._batches: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lipsync-write", daemon=True)

    def __enter__(self) -> "FrameWriter":
        self._thread.start()
        return self

    def put(self, finish: Callable[[], Iterable[np.ndarray]]) -> None:
        while True:
            self._raise_error()
            try:
                self._batches.put(finish, timeout=0.1)
                return
            except queue.Full:
                continue

    def _run(self) -> None:
        while (finish := self._batches.get()) is not None:
            if self._error is not None:
                continue  # keep draining so `put` never blocks on a dead writer
            try:
                for frame in finish():
                    self.sink(frame)
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread, raised there
                self._error = error

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def __exit__(self, exc_type, *_: object) -> None:
        self._batches.put(None)  # the writer always drains, so this returns
        self._thread.join()
        if exc_type is None:
            self._raise_error()


def read_ahead(items: Iterator, depth: int = 2) -> Generator[Any, None, None]:
    """`items` produced in a background thread, up to `depth` ahead of the consumer (reading source frames
    and drawing masks while the model runs); its errors are raised in the consumer. Closing the generator
    stops the thread."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        ready.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            ready.put((done, None))
        except BaseException as error:  # noqa: BLE001 - handed to the consumer's thread, raised there
            ready.put((done, error))

    thread = threading.Thread(target=produce, name="lipsync-read", daemon=True)
    thread.start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                ready.get(timeout=0.1)
            except queue.Empty:
                pass
        thread.join()


class _Batch:
    """One batch's inputs, read and prepared on the CPU ahead of the model."""

    def __init__(
        self,
        start: int,
        stop: int,
        sources: list[int],
        originals: list[np.ndarray],
        regions: list[Box],
        masks: list[np.ndarray],
    ):
        self.start, self.stop, self.sources = start, stop, sources
        self.originals, self.regions, self.masks = originals, regions, masks


def _batches(
    frames: FrameSequence,
    boxes: list[Box],
    landmarks: list[np.ndarray] | None,
    *,
    num_frames: int,
    batch_size: int,
    extra_margin: int,
    fps: float | None,
    source_fps: float | None,
    keep_masks: bool,
) -> Iterator[_Batch]:
    """The batches' source frames, crop regions and blend masks (a jaw mask per source frame is drawn once
    when the output shows source frames more than once)."""
    masks: dict[int, np.ndarray] = {}
    for start in range(0, num_frames, batch_size):
        stop = min(start + batch_size, num_frames)
        sources = [source_frame(i, len(frames), source_fps, fps) for i in range(start, stop)]
        originals = [np.asarray(frames[s]) for s in sources]
        regions = [crop_box(boxes[s], frame.shape, extra_margin) for s, frame in zip(sources, originals, strict=True)]
        batch_masks = []
        for source, region in zip(sources, regions, strict=True):
            mask = masks.get(source)
            if mask is None:
                height, width = region[3] - region[1], region[2] - region[0]
                mask = mouth_mask(height, width) if landmarks is None else jaw_mask(landmarks[source], region)
                if keep_masks and landmarks is not None:
                    masks[source] = mask
            batch_masks.append(mask)
        yield _Batch(start, stop, sources, originals, regions, batch_masks)


def _copy_back(frames: torch.Tensor) -> Callable[[], Iterable[np.ndarray]]:
    """Start copying blended frames to the host now; the returned callable waits for them (writer thread)."""
    if frames.device.type != "cuda":
        return lambda: list(frames.cpu().numpy())
    host = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
    host.copy_(frames, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def finish() -> list[np.ndarray]:
        copied.synchronize()
        return list(host.numpy())

    return finish


def _blend_reference(batch: _Batch, faces: np.ndarray) -> Callable[[], Iterable[np.ndarray]]:
    return lambda: (
        blend_mouth(frame, face, region, mask)
        for frame, face, region, mask in zip(batch.originals, faces, batch.regions, batch.masks, strict=True)
    )


@torch.inference_mode()
def run_lipsync(
    models: MuseTalkModels,
    frames: FrameSequence,
    boxes: list[Box],
    features: torch.Tensor | AudioWindows,
    *,
    num_frames: int,
    batch_size: int,
    extra_margin: int,
    sink: FrameSink,
    control: StageControl,
    fps: float | None = None,
    source_fps: float | None = None,
    landmarks: list[np.ndarray] | None = None,
    path: str = "device",
    latents: SourceLatents | None = None,
    pad_batches: bool | None = None,
) -> int:
    """Write `num_frames` lip-synced frames to `sink` in order; returns how many were written.

    `boxes` has one face box per source frame (gaps already filled); `features` comes from `audio_windows`
    (or `audio_features`). `source_fps` (the source's frame rate, with `fps` the output's) resamples the
    source so each output frame shows the source frame nearest its time (`frames.source_frame`): a 30 fps
    clip driven at 25 fps keeps its head motion at its own speed. None: one source frame per output frame.
    With `landmarks` (one [68, 2] array per source frame) each frame blends through its `jaw_mask`, without
    them through the rectangle.
    `path` "device": crops, resizes and the blend run as tensor ops on the model's device and only finished
    frames come back; "reference": OpenCV on the CPU, MuseTalk's own operations (the parity test compares
    the two). Source frames are read and masks drawn one batch ahead in a thread; finished frames go to the
    sink in another. `latents` (e.g. filled from the source cache) keeps the VAE encodings per source frame;
    by default they are kept only when the output shows a source frame twice. `pad_batches` (default: on
    CUDA) pads the last batch to `batch_size`.
    Reports "done/total frames" after every batch and stops with `Canceled` when the job was canceled.
    """
    if len(boxes) != len(frames):
        raise ValueError(f"{len(boxes)} face boxes for {len(frames)} frames")
    if any(box is None for box in boxes):
        raise ValueError("every frame needs a face box (use faces.fill_missing)")
    if len(features) < num_frames:
        raise ValueError(f"audio features cover {len(features)} frames, {num_frames} requested")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if path not in LIPSYNC_PATHS:
        raise ValueError(f"path must be one of {LIPSYNC_PATHS}, not {path!r}")
    repeats = shows_a_frame_twice(num_frames, len(frames), source_fps, fps)
    if latents is None:
        latents = SourceLatents(models, keep=repeats and len(frames) <= MAX_KEPT_SOURCE_FRAMES)
    pad_to = batch_size if (models.device.type == "cuda" if pad_batches is None else pad_batches) else 0
    batches = read_ahead(
        _batches(
            frames,
            boxes,
            landmarks,
            num_frames=num_frames,
            batch_size=batch_size,
            extra_margin=extra_margin,
            fps=fps,
            source_fps=source_fps,
            keep_masks=repeats and len(frames) <= MAX_KEPT_SOURCE_FRAMES,
        )
    )
    with FrameWriter(sink) as writer:
        try:
            for batch in batches:
                prompts = features[batch.start : batch.stop]
                if path == "reference":
                    faces = redraw_faces(
                        models, latents(batch.sources, batch.originals, batch.regions), prompts, pad_to=pad_to
                    )
                    writer.put(_blend_reference(batch, faces.permute(0, 2, 3, 1).cpu().numpy()))
                else:
                    on_device = torch.from_numpy(np.stack(batch.originals)).to(models.device, non_blocking=True)
                    crops = functools.partial(_crops_at, on_device, batch.regions, models.crop_size)
                    faces = redraw_faces(models, latents.get(batch.sources, crops), prompts, pad_to=pad_to)
                    writer.put(_copy_back(blend_on_device(on_device, faces, batch.regions, batch.masks)))
                control.step(batch.stop, num_frames, "frames")
        finally:
            batches.close()
    if num_frames == 0:
        control.step(0, 0, "frames")
    return num_frames


def _crops_at(frames: torch.Tensor, regions: list[Box], size: int, positions: list[int]) -> torch.Tensor:
    chosen = frames if positions == list(range(len(frames))) else frames[positions]
    return device_crops(chosen, [regions[p] for p in positions], size)
