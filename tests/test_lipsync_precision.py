"""ENCORE_LIPSYNC_PRECISION: validated with the settings, honoured where MuseTalk is loaded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.core.config import Settings
from app.pipeline.lipsync.inference import generate_faces, unet_latents
from app.pipeline.lipsync.musetalk import load_musetalk, precision_name, resolve_dtype
from app.pipeline.lipsync.stages import LipsyncModels
from harness.models import tiny_musetalk_profile
from harness.media import face_image


def test_precision_defaults_to_auto_and_takes_fp16_or_fp32(monkeypatch):
    monkeypatch.delenv("ENCORE_LIPSYNC_PRECISION", raising=False)
    assert Settings().lipsync_precision == "auto"
    for value, expected in (("fp16", "fp16"), ("fp32", "fp32"), (" FP32 ", "fp32"), ("auto", "auto")):
        monkeypatch.setenv("ENCORE_LIPSYNC_PRECISION", value)
        assert Settings().lipsync_precision == expected


@pytest.mark.parametrize("value", ["bf16", "float16", "half", ""])
def test_invalid_precision_is_refused_with_the_settings_name(monkeypatch, value):
    monkeypatch.setenv("ENCORE_LIPSYNC_PRECISION", value)
    with pytest.raises(ValueError, match=r"ENCORE_LIPSYNC_PRECISION must be auto, fp16 or fp32, not"):
        Settings()


def test_auto_is_fp16_on_cuda_and_fp32_on_cpu():
    assert resolve_dtype(torch.device("cuda"), "auto") == torch.float16  # decided without touching the GPU
    assert resolve_dtype(torch.device("cuda"), "fp32") == torch.float32
    assert resolve_dtype(torch.device("cpu"), "auto") == torch.float32
    with pytest.raises(ValueError, match="auto, fp16 or fp32"):
        resolve_dtype(torch.device("cpu"), "fp8")


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return tiny_musetalk_profile(tmp_path_factory)


def _dtypes(models) -> set[torch.dtype]:
    return {p.dtype for module in (models.unet, models.vae, models.whisper) for p in module.parameters()}


@pytest.mark.parametrize("precision", ["auto", "fp32"])
def test_cpu_loads_fp32_for_auto_and_fp32(profile, precision):
    models = load_musetalk(profile, "cpu", precision=precision)
    assert models.dtype == torch.float32 and _dtypes(models) == {torch.float32}
    assert precision_name(models.dtype) == "fp32"


def test_fp16_on_cpu_loads_half_weights_and_runs(profile):
    """torch's CPU build has fp16 kernels for everything MuseTalk runs (slower than fp32, but it works),
    so fp16 asked on a CPU is honoured: every weight is half and a frame comes out finite."""
    models = LipsyncModels(profile, "keep_loaded", device="cpu", precision="fp16").musetalk()
    assert models.dtype == torch.float16 and _dtypes(models) == {torch.float16}
    assert precision_name(models.dtype) == "fp16"
    crop = face_image(models.crop_size)[None]
    with torch.inference_mode():
        latents = unet_latents(models, crop)
        assert latents.dtype == torch.float16
        face = generate_faces(models, latents, torch.randn(1, 10 * models.audio_layers, models.audio_dim))
    assert face.shape == crop.shape and face.dtype == np.uint8 and 0 < face.mean() < 255
