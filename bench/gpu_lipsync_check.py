"""GPU check for lip-sync (run on a CUDA machine; prints JSON lines):
1. the tiny MuseTalk models written in the real layout, loaded by the real loader in fp16 on CUDA, and
   run_lipsync over a ping-pong clip: output finite, not black, frame count exact;
2. speed at MuseTalk's real sizes (random weights: UNet blocks 320/640/1280/1280 with cross-attention 384,
   sd-vae-sized AutoencoderKL, whisper-tiny encoder) in fp16: frames per second of run_lipsync, against the
   same run's bare UNet+VAE time as the in-run baseline.

    python bench/gpu_lipsync_check.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def tone_wav(path: Path, seconds: float) -> Path:
    t = np.arange(int(16000 * seconds)) / 16000
    samples = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype(np.int16)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(samples.tobytes())
    return path


def clip(n: int, size: int = 512) -> list[np.ndarray]:
    import skimage.data

    base = skimage.data.astronaut()[:size, :size]
    return [np.roll(base, shift=i, axis=1).copy() for i in range(n)]


def run(models, frames, seconds: float, batch_size: int) -> tuple[list[np.ndarray], float]:
    from app.pipeline.control import StageControl
    from app.pipeline.lipsync.inference import audio_features, run_lipsync

    wav = tone_wav(Path(tempfile.mkdtemp()) / "a.wav", seconds)
    num = int(seconds * 25)
    features = audio_features(models, wav, fps=25, num_frames=num, padding_left=2, padding_right=2)
    box = (177, 66, 272, 161)  # the astronaut's face in the 512 px photo (Haar detection)
    out: list[np.ndarray] = []
    sync()
    started = time.perf_counter()
    run_lipsync(
        models,
        frames,
        [box] * len(frames),
        features,
        num_frames=num,
        batch_size=batch_size,
        extra_margin=10,
        sink=out.append,
        control=StageControl(),
    )
    sync()
    return out, time.perf_counter() - started


def tiny_through_loader() -> dict:
    from app.pipeline.lipsync.musetalk import load_musetalk, write_tiny_musetalk
    from app.pipeline.profiles import load_lipsync_profile

    profile = load_lipsync_profile("tiny", Path(tempfile.mkdtemp()) / "lipsync-tiny")
    write_tiny_musetalk(profile, seed=3)
    models = load_musetalk(profile, DEVICE)
    frames = clip(20)
    out, seconds = run(models, frames, 2.0, batch_size=8)
    stacked = np.stack(out)
    return {
        "dtype": str(models.dtype),
        "frames": len(out),
        "seconds": round(seconds, 3),
        "finite": bool(np.isfinite(stacked).all()),
        "mean": round(float(stacked.mean()), 1),
        "source_mean": round(float(np.stack(frames).mean()), 1),
    }


def real_size_speed(batch_size: int = 32, seconds: float = 8.0) -> dict:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperModel
    from app.pipeline.lipsync.musetalk import MuseTalkModels

    device, dtype = torch.device(DEVICE), torch.float16
    unet = (
        UNet2DConditionModel(
            sample_size=32,
            in_channels=8,
            out_channels=4,
            cross_attention_dim=384,
            attention_head_dim=8,
            block_out_channels=(320, 640, 1280, 1280),
            layers_per_block=2,
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        )
        .to(device, dtype)
        .eval()
    )
    vae = (
        AutoencoderKL(
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            latent_channels=4,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            sample_size=256,
        )
        .to(device, dtype)
        .eval()
    )
    config = WhisperConfig(
        d_model=384,
        encoder_layers=4,
        encoder_attention_heads=6,
        encoder_ffn_dim=1536,
        decoder_layers=1,
        num_mel_bins=80,
    )
    whisper = WhisperModel(config).encoder.to(device, dtype).eval()
    models = MuseTalkModels(
        unet=unet,
        vae=vae,
        whisper=whisper,
        feature_extractor=WhisperFeatureExtractor(feature_size=80),
        device=device,
        dtype=dtype,
    )
    frames = clip(50)
    run(models, frames, 2.0, batch_size)  # warm-up
    out, elapsed = run(models, frames, seconds, batch_size)
    latents = torch.randn(batch_size, 8, 32, 32, device=device, dtype=dtype)
    prompt = torch.randn(batch_size, 50, 384, device=device, dtype=dtype)
    with torch.inference_mode():
        sync()
        started = time.perf_counter()
        for _ in range(len(out) // batch_size):
            sample = unet(latents, 0, encoder_hidden_states=prompt).sample
            vae.decode(sample / 0.18215)
        sync()
    bare = time.perf_counter() - started
    bare_fps = (len(out) // batch_size) * batch_size / bare
    stacked = np.stack(out)
    return {
        "frames": len(out),
        "batch_size": batch_size,
        "fps": round(len(out) / elapsed, 1),
        "bare_unet_vae_fps": round(bare_fps, 1),
        "ratio_to_bare": round((len(out) / elapsed) / bare_fps, 3),
        "finite": bool(np.isfinite(stacked).all()),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else None,
        "unet_params_m": round(sum(p.numel() for p in unet.parameters()) / 1e6),
    }


def main() -> None:
    for name, check in (("tiny_through_loader_fp16", tiny_through_loader), ("real_size_speed", real_size_speed)):
        if DEVICE == "cpu" and name == "real_size_speed":
            continue  # fp16 at real size is a GPU measurement
        try:
            result = check()
        except Exception as exc:  # noqa: BLE001 - one device call: a failed check is reported, the next still runs
            result = {"exception": repr(exc)}
        print(json.dumps({name: result}), flush=True)


if __name__ == "__main__":
    main()
