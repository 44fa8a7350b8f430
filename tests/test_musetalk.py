"""Tiny MuseTalk models written in the real on-disk layout load through the same loader as the real ones."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from diffusers import UNet2DConditionModel

from app.pipeline.lipsync.musetalk import load_musetalk, sinusoidal_table, write_tiny_musetalk
from app.pipeline.profiles import load_lipsync_profile

EXPECTED_FILES = {
    "musetalkV15/unet.pth",
    "musetalkV15/musetalk.json",
    "sd-vae/config.json",
    "sd-vae/diffusion_pytorch_model.bin",
    "whisper/config.json",
    "whisper/pytorch_model.bin",
    "whisper/preprocessor_config.json",
}


@pytest.fixture
def offline(monkeypatch):
    """No network: the hub is told to stay offline and any socket connection fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(self, address):
        raise AssertionError(f"network access to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture
def profile(tmp_path):
    profile = load_lipsync_profile("tiny", tmp_path / "lipsync-tiny")
    write_tiny_musetalk(profile, seed=3)
    return profile


def test_tiny_models_use_the_real_file_layout(profile):
    files = {str(p.relative_to(profile.model_dir)) for p in profile.model_dir.rglob("*") if p.is_file()}
    assert files == EXPECTED_FILES


def test_unet_pth_is_a_bare_diffusers_state_dict(profile):
    """MuseTalk loads unet.pth with UNet2DConditionModel(**musetalk.json).load_state_dict(weights): no
    wrapper dict, no "module."/"unet." prefixes."""
    state = torch.load(profile.unet_path, map_location="cpu", weights_only=True)
    config = json.loads(profile.unet_config_path.read_text())
    assert set(state) == set(UNet2DConditionModel(**config).state_dict())
    assert "conv_in.weight" in state and state["conv_in.weight"].shape[1] == 8
    assert state["conv_out.weight"].shape[0] == 4
    assert not any(key.startswith(("module.", "unet.", "model.")) for key in state)
    cross = state["down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight"]
    assert cross.shape[1] == config["cross_attention_dim"]


def test_round_trip_through_load_musetalk(profile, offline):
    models = load_musetalk(profile, "cpu")
    assert models.device == torch.device("cpu") and models.dtype == torch.float32

    unet_state = torch.load(profile.unet_path, map_location="cpu", weights_only=True)
    loaded = models.unet.state_dict()
    assert set(loaded) == set(unet_state)
    assert all(torch.equal(loaded[k], unet_state[k]) for k in unet_state)
    assert models.unet.config.in_channels == 8 and models.unet.config.out_channels == 4

    vae_state = torch.load(profile.vae_dir / "diffusion_pytorch_model.bin", map_location="cpu", weights_only=True)
    assert all(torch.equal(models.vae.state_dict()[k], v) for k, v in vae_state.items())

    whisper_state = torch.load(profile.whisper_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    encoder_state = {
        k.removeprefix("model.encoder."): v for k, v in whisper_state.items() if k.startswith("model.encoder.")
    }
    assert set(models.whisper.state_dict()) == set(encoder_state)
    assert all(torch.equal(models.whisper.state_dict()[k], v) for k, v in encoder_state.items())

    config = json.loads(profile.unet_config_path.read_text())
    assert config["cross_attention_dim"] == models.audio_dim == 64
    assert models.audio_layers == 3  # embedding output + 2 encoder layers
    assert models.feature_extractor.feature_size == 80 and models.feature_extractor.sampling_rate == 16000
    assert models.scaling_factor == pytest.approx(0.18215)


def test_vae_downsamples_a_256_crop_to_32x32_latents(profile, offline):
    models = load_musetalk(profile, "cpu")
    with torch.inference_mode():
        latents = models.vae.encode(torch.zeros(1, 3, 256, 256)).latent_dist.mode()
        assert latents.shape == (1, 4, 32, 32)
        assert models.vae.decode(latents).sample.shape == (1, 3, 256, 256)


def test_writer_is_deterministic_by_seed(tmp_path, profile):
    again = load_lipsync_profile("tiny", tmp_path / "again")
    other = load_lipsync_profile("tiny", tmp_path / "other")
    write_tiny_musetalk(again, seed=3)
    write_tiny_musetalk(other, seed=4)
    first, second, third = (torch.load(p.unet_path, weights_only=True) for p in (profile, again, other))
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["conv_in.weight"], third["conv_in.weight"])


def test_missing_files_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="unet.pth"):
        load_musetalk(load_lipsync_profile("tiny", tmp_path / "empty"), "cpu")


def test_positional_table_matches_musetalks_formula():
    table = sinusoidal_table(50, 384)
    assert table.shape == (50, 384)
    assert torch.allclose(table[0, 0::2], torch.zeros(192)) and torch.allclose(table[0, 1::2], torch.ones(192))
    position, column = 7, 10
    expected = torch.sin(torch.tensor(position * 10000 ** (-column / 384)))
    assert torch.isclose(table[position, column], expected, atol=1e-5)


def _heads(models) -> set[int]:
    return {module.heads for name, module in models.unet.named_modules() if name.endswith(("attn1", "attn2"))}


def test_shaped_profile_is_the_tiny_unet_with_one_head_of_musetalks_width(tmp_path, profile, offline):
    """bench/throughput.py's `shaped` lip-sync: the tiny files and weights' shapes, its UNet's attention in one head
    over its 32 channels (the tiny's 8 heads of 4 are no real model's width), loaded by the same loader."""
    from app.pipeline.tiny import write_tiny_lipsync_models

    shaped = load_lipsync_profile(
        "shaped", write_tiny_lipsync_models(tmp_path / "shaped", seed=3, profile_name="shaped")
    )
    tiny_models, shaped_models = load_musetalk(profile, "cpu"), load_musetalk(shaped, "cpu")
    assert _heads(tiny_models) == {8} and _heads(shaped_models) == {1}
    tiny_state, shaped_state = tiny_models.unet.state_dict(), shaped_models.unet.state_dict()
    assert {k: v.shape for k, v in tiny_state.items()} == {k: v.shape for k, v in shaped_state.items()}
    with torch.inference_mode():
        latents = torch.zeros(1, 8, 32, 32)
        prompt = torch.zeros(1, 10, shaped_models.audio_dim)
        out = shaped_models.unet(latents, 0, encoder_hidden_states=prompt).sample
    assert out.shape == (1, 4, 32, 32) and torch.isfinite(out).all()


def test_lipsync_models_are_rewritten_when_the_profile_changes(tmp_path):
    """The completion marker names the profile: a folder written as `tiny` is rewritten, not reused, as `shaped`."""
    from app.pipeline.tiny import write_tiny_lipsync_models

    out = tmp_path / "models"
    write_tiny_lipsync_models(out, seed=3)
    assert json.loads((out / "musetalkV15" / "musetalk.json").read_text())["attention_head_dim"] == 8
    write_tiny_lipsync_models(out, seed=3, profile_name="shaped")
    assert json.loads((out / "musetalkV15" / "musetalk.json").read_text())["attention_head_dim"] == 1
