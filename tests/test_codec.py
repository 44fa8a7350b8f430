"""Khala codec decoder: checkpoint format, key layout, chunked decoding with crossfade, progress/cancel."""

from __future__ import annotations

from itertools import pairwise
import dataclasses
import os
import pickle
import re
from pathlib import Path

import numpy as np

import pytest
import torch

from app.pipeline import safe_pickle
from app.pipeline.music.codec import (
    CodecLoadError,
    KhalaCodecDecoder,
    decode_codes,
    fade_in,
    load_codec,
    plan_chunks,
    write_tiny_codec,
)
from app.pipeline.control import Canceled, StageControl
from app.pipeline.profiles import load_profile

RECEPTIVE_MARGIN = 12  # frames; measured: one changed frame moves output within ~10 frames of it


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    profile = load_profile("tiny", tmp_path_factory.mktemp("models"))
    written = write_tiny_codec(profile.codec, profile.codec_path, seed=0)
    return profile, written, load_codec(profile.codec, profile.codec_path, "cpu")


def random_codes(spec, frames: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.codebook_size, (spec.num_codebooks, frames), generator=gen)


def full_decode(decoder: KhalaCodecDecoder, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return decoder(codes)


# ------------------------------------------------------------------------------------ checkpoint format


def test_round_trip_gives_identical_weights_and_output(tiny):
    profile, written, loaded = tiny
    assert written.state_dict().keys() == loaded.state_dict().keys()
    for key, value in written.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    codes = random_codes(profile.codec, 20)
    assert torch.equal(full_decode(written, codes), full_decode(loaded, codes))
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())


def test_tiny_checkpoint_is_lightning_style_with_non_decoder_keys(tiny):
    profile, _, _ = tiny
    ckpt = torch.load(profile.codec_path, weights_only=True)
    keys = ckpt["state_dict"].keys()
    assert {"epoch", "global_step", "state_dict"} <= ckpt.keys()
    assert all(k.startswith(("generator.", "discriminator.")) for k in keys)
    assert any(k.startswith("discriminator.") for k in keys)
    assert any(k.startswith("generator.encoder.") for k in keys)
    assert "generator.quantizer.vq_layer_63._codebook.embed_avg" in keys


def test_seed_decides_weights(tmp_path):
    spec = load_profile("tiny", tmp_path).codec
    a = write_tiny_codec(spec, tmp_path / "a.ckpt", seed=1).state_dict()
    b = write_tiny_codec(spec, tmp_path / "b.ckpt", seed=1).state_dict()
    c = write_tiny_codec(spec, tmp_path / "c.ckpt", seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["quantizer.embed_5"], c["quantizer.embed_5"])


def test_keys_mirror_khala_dacrvq_layout(tiny):
    """Names from Khala models/Decoder/{dac.py,rvq.py}: DacRVQ.decoder.model = [conv, 4 x DecoderBlock,
    Snake1d, conv] with old-style weight norm; ResidualVectorQuantization registers embed_{i}."""
    keys = set(tiny[2].state_dict())
    assert {
        "decoder.model.0.weight_g",
        "decoder.model.0.weight_v",
        "decoder.model.0.bias",
        "decoder.model.1.block.0.alpha",
        "decoder.model.1.block.1.weight_v",
        "decoder.model.4.block.4.block.3.bias",
        "decoder.model.5.alpha",
        "decoder.model.6.weight_g",
        "quantizer.embed_0",
        "quantizer.embed_63",
    } <= keys
    assert not any(k.startswith("decoder.model.7") for k in keys)  # Khala commented out the tanh


def test_real_profile_shapes_match_khala_config():
    """dac_rvq_1024_64_golden.yaml: d_latent 128, n_filters 192 (x 2**4 = 3072), rates [8,8,8,4], 2 out."""
    with torch.device("meta"):
        model = KhalaCodecDecoder(load_profile("khala").codec)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["quantizer.embed_63"] == (1024, 128)
    assert shapes["decoder.model.0.weight_v"] == (3072, 128, 7)
    assert shapes["decoder.model.1.block.1.weight_v"] == (3072, 1536, 16)  # ConvTranspose: in, out, 2*rate
    assert shapes["decoder.model.4.block.1.weight_v"] == (384, 192, 8)
    assert shapes["decoder.model.6.weight_v"] == (2, 192, 7)


def _resave(profile, tmp_path, edit) -> str:
    ckpt = torch.load(profile.codec_path, weights_only=True)
    edit(ckpt["state_dict"])
    path = tmp_path / "edited.ckpt"
    torch.save(ckpt, path)
    return path


def test_missing_key_is_named(tiny, tmp_path):
    profile = tiny[0]
    key = "generator.decoder.model.3.block.2.block.1.weight_g"
    path = _resave(profile, tmp_path, lambda sd: sd.pop(key))
    with pytest.raises(CodecLoadError, match="missing keys: " + re.escape(key)):
        load_codec(profile.codec, path)


def test_unexpected_generator_key_is_named(tiny, tmp_path):
    profile = tiny[0]
    path = _resave(profile, tmp_path, lambda sd: sd.update({"generator.decoder.model.7.weight": torch.ones(1)}))
    with pytest.raises(CodecLoadError, match=r"unexpected keys: generator\.decoder\.model\.7\.weight"):
        load_codec(profile.codec, path)


def test_wrong_profile_gives_shape_error(tiny):
    profile = tiny[0]
    other = dataclasses.replace(profile.codec, codebook_dim=8)
    with pytest.raises(CodecLoadError, match=r"shape mismatches.*quantizer\.embed_0 \(32, 16\) != \(32, 8\)"):
        load_codec(other, profile.codec_path)


def test_unprefixed_or_unreadable_checkpoint(tiny, tmp_path):
    profile = tiny[0]
    bare = tmp_path / "bare.ckpt"
    torch.save({"state_dict": {"decoder.model.0.bias": torch.zeros(1)}}, bare)
    with pytest.raises(CodecLoadError, match="no 'generator.' keys"):
        load_codec(profile.codec, bare)
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(CodecLoadError, match="not a readable torch checkpoint"):
        load_codec(profile.codec, junk)
    with pytest.raises(CodecLoadError, match="not found"):
        load_codec(profile.codec, tmp_path / "absent.ckpt")


class AttributeDict(dict):
    """Stands for lightning.fabric.utilities.data.AttributeDict: a dict subclass Lightning pickles hparams as."""


class RunsCode:
    """What a hostile checkpoint could hold: unpickling it with plain pickle runs a command."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_lightning_checkpoint_with_pickled_objects_loads_without_running_them(tiny, tmp_path):
    """A real training .ckpt: DictConfig hyper-parameters, an AttributeDict, callback and loop states with
    numpy values and paths, and an object whose unpickling would run a command. The decoder loads exactly;
    nothing in the file runs."""
    from omegaconf import OmegaConf

    profile, written, _ = tiny
    ckpt = torch.load(profile.codec_path, weights_only=True)
    marker = tmp_path / "code-ran"
    ckpt["hyper_parameters"] = OmegaConf.create(
        {"generator": {"n_codebooks": 64, "rates": [8, 8, 8, 4]}, "optim": {"lr": 1e-4}}
    )
    ckpt["hparams"] = AttributeDict(lr=1e-4, batch_size=16)
    ckpt["callbacks"]["ModelCheckpoint{}"] = {
        "best_k_models": {Path("/ckpt/a.ckpt"): np.float32(0.25)},
        "kth_value": np.array([0.5]),
        "dirpath": Path("/ckpt"),
    }
    ckpt["loops"]["fit_loop"]["state_dict"] = {"hook": RunsCode(marker)}
    lightning = tmp_path / "dac_rvq_2490000.ckpt"
    torch.save(ckpt, lightning)
    with pytest.raises(pickle.UnpicklingError):  # what weights_only loading (the old loader) said of it
        torch.load(lightning, weights_only=True)

    loaded = load_codec(profile.codec, lightning, "cpu")
    assert not marker.exists()
    codes = random_codes(profile.codec, 20)
    assert torch.equal(full_decode(written, codes), full_decode(loaded, codes))
    raw = safe_pickle.load_inert(lightning)
    assert isinstance(raw["hyper_parameters"], safe_pickle.Opaque)
    assert raw["hyper_parameters"].pickled_global == "omegaconf.dictconfig.DictConfig"
    assert raw["loops"]["fit_loop"]["state_dict"]["hook"].pickled_global in ("posix.system", "os.system")
    assert not marker.exists()


def test_state_dict_entries_must_be_tensors(tiny, tmp_path):
    profile = tiny[0]
    ckpt = torch.load(profile.codec_path, weights_only=True)
    ckpt["state_dict"]["generator.decoder.model.0.bias"] = AttributeDict(values=[0.0])
    odd = tmp_path / "odd.ckpt"
    torch.save(ckpt, odd)
    with pytest.raises(CodecLoadError, match="not tensors: generator.decoder.model.0.bias"):
        load_codec(profile.codec, odd)


def test_khala_codec_file_is_found_by_its_training_step(tmp_path):
    """The reference ships checkpoints/dac_rvq_<step>.ckpt; the khala profile takes the newest step."""
    profile = load_profile("khala", tmp_path)
    (tmp_path / "checkpoints").mkdir()
    for step in (990_000, 2_490_000, 10_000):
        (tmp_path / "checkpoints" / f"dac_rvq_{step}.ckpt").write_bytes(b"")
    assert profile.codec_path == tmp_path / "checkpoints" / "dac_rvq_2490000.ckpt"
    assert profile.tokenizer_dir == tmp_path / "models" / "Tokenizer"
    assert profile.backbone_dir == tmp_path / "checkpoints" / "backbone"
    assert profile.superres_dir == tmp_path / "checkpoints" / "superresolution"


def test_layer_alias_must_equal_codebook(tiny, tmp_path):
    profile = tiny[0]
    path = _resave(
        profile, tmp_path, lambda sd: sd.update({"generator.quantizer.vq_layer_2._codebook.embed": torch.zeros(32, 16)})
    )
    with pytest.raises(CodecLoadError, match=r"vq_layer_2\._codebook\.embed differs"):
        load_codec(profile.codec, path)


# ------------------------------------------------------------------------------------ model


def test_codebooks_are_summed_in_order(tiny):
    profile, _, decoder = tiny
    codes = random_codes(profile.codec, 5)
    with torch.inference_mode():
        z = decoder.quantizer(codes)
    q = decoder.quantizer
    expected = sum(getattr(q, f"embed_{i}")[codes[i]] for i in range(64)).t().unsqueeze(0)
    assert z.shape == (1, 16, 5)
    torch.testing.assert_close(z, expected)


def test_no_tanh_output_can_exceed_one(tmp_path):
    profile = load_profile("tiny", tmp_path)
    decoder = write_tiny_codec(profile.codec, profile.codec_path, seed=0)
    with torch.no_grad():
        decoder.decoder.model[-1].bias.fill_(3.0)
    audio = decode_codes(decoder, random_codes(profile.codec, 4))
    assert audio.max() > 2.0


# ------------------------------------------------------------------------------------ chunked decoding


def test_plan_chunks_covers_with_exact_overlaps():
    assert plan_chunks(10, 64, 16) == [(0, 10)]
    assert plan_chunks(64, 64, 16) == [(0, 64)]
    assert plan_chunks(65, 64, 16) == [(0, 64), (48, 65)]
    for frames in range(65, 400, 7):
        chunks = plan_chunks(frames, 64, 16)
        assert chunks[0][0] == 0 and chunks[-1][1] == frames
        assert all(end - start == 64 for start, end in chunks[:-1])
        assert all(prev[1] - nxt[0] == 16 for prev, nxt in pairwise(chunks))
        assert chunks[-1][1] - chunks[-1][0] > 16  # the last chunk reaches past its crossfade


@pytest.mark.parametrize("frames", [1, 7, 63, 64, 65, 112, 113])
def test_output_shape_and_finite(tiny, frames):
    profile, _, decoder = tiny
    audio = decode_codes(decoder, random_codes(profile.codec, frames, seed=frames))
    assert audio.shape == (2, frames * 2048) and audio.dtype == torch.float32
    assert torch.isfinite(audio).all() and audio.abs().max() > 0


def test_single_chunk_equals_full_decode(tiny):
    profile, _, decoder = tiny
    codes = random_codes(profile.codec, 64)
    torch.testing.assert_close(decode_codes(decoder, codes), full_decode(decoder, codes), atol=1e-5, rtol=0)


def test_chunked_equals_full_decode_away_from_seams(tiny):
    profile, _, decoder = tiny
    spec = profile.codec
    codes = random_codes(spec, 170)
    chunks = plan_chunks(170, spec.chunk_frames, spec.overlap_frames)
    assert len(chunks) == 4
    chunked, full = decode_codes(decoder, codes), full_decode(decoder, codes)
    edges = sorted({e for start, end in chunks for e in (start, end)} - {0, 170})
    keep = torch.ones(170, dtype=torch.bool)
    for edge in edges:
        keep[max(0, edge - RECEPTIVE_MARGIN) : edge + RECEPTIVE_MARGIN] = False
    keep = keep.repeat_interleave(2048)
    assert keep.sum() == (36 + 8 + 8) * 2048  # [0,36) [76,84) [124,132): inside chunks 0, 1, 2
    torch.testing.assert_close(chunked[:, keep], full[:, keep], atol=1e-5, rtol=0)
    assert not torch.allclose(chunked[:, ~keep], full[:, ~keep], atol=1e-5)  # seams do differ: cut edges


def test_seams_are_linear_crossfade_of_neighbouring_chunks(tiny):
    profile, _, decoder = tiny
    spec, hop = profile.codec, profile.codec.hop_length
    codes = random_codes(spec, 100, seed=3)
    (s0, e0), (s1, e1) = plan_chunks(100, spec.chunk_frames, spec.overlap_frames)
    first, second = full_decode(decoder, codes[:, s0:e0]), full_decode(decoder, codes[:, s1:e1])
    out = decode_codes(decoder, codes)
    n = spec.overlap_frames * hop
    weight = torch.linspace(0.5 / n, 1 - 0.5 / n, n)  # incoming chunk's share, rising linearly
    expected = first[:, s1 * hop :] * (1 - weight) + second[:, :n] * weight
    torch.testing.assert_close(out[:, s1 * hop : e0 * hop], expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(out[:, : s1 * hop], first[:, : s1 * hop], atol=0, rtol=0)
    torch.testing.assert_close(out[:, e0 * hop :], second[:, n:], atol=0, rtol=0)
    # the fade gives each chunk's zero-padded cut edge little weight: much closer to the full decode
    # than switching chunks at either end of the overlap (a reversed fade would do as badly as those)
    full = full_decode(decoder, codes)[:, s1 * hop : e0 * hop]
    faded = (out[:, s1 * hop : e0 * hop] - full).abs().max()
    switch_early = (second[:, :n] - full).abs().max()
    switch_late = (first[:, s1 * hop :] - full).abs().max()
    assert faded < 0.25 * min(switch_early, switch_late)


def test_fade_weights_are_symmetric_and_complementary():
    w = fade_in(8)
    torch.testing.assert_close(w + w.flip(0), torch.ones(8))
    assert torch.all(w[1:] > w[:-1]) and 0 < w[0] < w[-1] < 1


def test_bad_codes_rejected(tiny):
    profile, _, decoder = tiny
    with pytest.raises(ValueError, match=r"\[64, frames>=1\]"):
        decode_codes(decoder, torch.zeros(63, 10, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 32\)"):
        decode_codes(decoder, torch.full((64, 10), 32))
    with pytest.raises(ValueError, match="integers"):
        decode_codes(decoder, torch.zeros(64, 10))


# ------------------------------------------------------------------------------------ progress / cancel


def test_progress_reports_every_chunk(tiny):
    profile, _, decoder = tiny
    reports: list[tuple[float, str]] = []
    control = StageControl(report=lambda f, d: reports.append((f, d)))
    decode_codes(decoder, random_codes(profile.codec, 170), control)
    assert [d for _, d in reports] == ["1/4 chunks", "2/4 chunks", "3/4 chunks", "4/4 chunks"]
    assert [f for f, _ in reports] == [0.25, 0.5, 0.75, 1.0]


def test_cancel_stops_between_chunks(tiny):
    profile, _, decoder = tiny
    reports: list[str] = []
    control = StageControl(report=lambda f, d: reports.append(d), cancel_requested=lambda: len(reports) >= 2)
    with pytest.raises(Canceled):
        decode_codes(decoder, random_codes(profile.codec, 170), control)
    assert reports == ["1/4 chunks", "2/4 chunks"]


def test_cancel_before_start_decodes_nothing(tiny):
    profile, _, decoder = tiny
    reports: list[str] = []
    control = StageControl(report=lambda f, d: reports.append(d), cancel_requested=lambda: True)
    with pytest.raises(Canceled):
        decode_codes(decoder, random_codes(profile.codec, 170), control)
    assert reports == []
