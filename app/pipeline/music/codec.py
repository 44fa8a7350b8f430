"""Khala codec decoder: 64 RVQ code layers -> stereo 44.1 kHz audio.

The module tree mirrors the public Khala repo (`Khala-Music-AI/Khala`, models/Decoder/): `DacRVQ` holds
`encoder`, `quantizer` (a `ResidualVectorQuantization` whose codebooks are registered as `embed_{i}`) and
`decoder` (a DAC-style `Decoder` whose layers live in `model`, tanh commented out). Its training checkpoint
is a Lightning `.ckpt` whose `state_dict` keys carry a `generator.` prefix. Only the decode path is built
here, so the checkpoint's `decoder.*` and `quantizer.embed_{i}` keys load strictly and the rest of it
(encoder, per-layer EMA statistics, discriminator, optimizer) is dropped by name.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from app.pipeline import safe_pickle
from app.pipeline.control import StageControl
from app.pipeline.profiles import CodecSpec

with warnings.catch_warnings():  # dac scripts its snake with the deprecated torch.jit.script
    warnings.simplefilter("ignore", DeprecationWarning)
    from dac.model.dac import DecoderBlock
    from dac.nn.layers import Snake1d, WNConv1d

GENERATOR_PREFIX = "generator."
# Generator keys the decode path does not need: the encoder, and each RVQ layer's codebook wrapper, which
# holds EMA training statistics plus `embed`, the same tensor as `quantizer.embed_{i}` (checked on load).
_UNUSED_GENERATOR_KEY = re.compile(
    r"^(encoder\..*|quantizer\.vq_layer_\d+\._codebook\.(embed|embed_avg|cluster_size|inited))$"
)
_LAYER_ALIAS = re.compile(r"^quantizer\.vq_layer_(\d+)\._codebook\.embed$")


class CodecLoadError(RuntimeError):
    """The codec checkpoint cannot be read or does not fit the profile's CodecSpec."""


class CodebookSum(nn.Module):
    """The RVQ codebooks as `embed_{i}` [codebook_size, dim]; decoding sums one row per codebook."""

    def __init__(self, num_codebooks: int, codebook_size: int, dim: int):
        super().__init__()
        self.num_codebooks = num_codebooks
        for i in range(num_codebooks):
            self.register_parameter(f"embed_{i}", nn.Parameter(torch.empty(codebook_size, dim)))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [num_codebooks, T] -> latent [1, dim, T]."""
        z = F.embedding(codes[0], self.get_parameter("embed_0"))
        for i in range(1, self.num_codebooks):
            z = z + F.embedding(codes[i], self.get_parameter(f"embed_{i}"))
        return z.t().unsqueeze(0)


class WaveDecoder(nn.Module):
    """DAC-style upsampler: conv in, one DecoderBlock per rate (halving channels), snake, conv out.

    No tanh (Khala's decoder has it commented out): output may exceed [-1, 1]; export clips it.
    """

    def __init__(self, latent_dim: int, channels: int, rates: tuple[int, ...], out_channels: int):
        super().__init__()
        layers: list[nn.Module] = [WNConv1d(latent_dim, channels, kernel_size=7, padding=3)]
        for i, rate in enumerate(rates):
            layers.append(DecoderBlock(channels >> i, channels >> (i + 1), rate))
        last = channels >> len(rates)
        layers += [Snake1d(last), WNConv1d(last, out_channels, kernel_size=7, padding=3)]
        self.model = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.model(z)


class KhalaCodecDecoder(nn.Module):
    """Codes [num_codebooks, T] -> audio [audio_channels, T * hop]; keys as in Khala's DacRVQ."""

    def __init__(self, spec: CodecSpec):
        super().__init__()
        if spec.decoder_channels % (2 ** len(spec.upsample_rates)):
            raise ValueError(
                f"decoder_channels {spec.decoder_channels} must be divisible by "
                f"2**{len(spec.upsample_rates)} (channels halve at every upsampling block)"
            )
        if any(rate % 2 for rate in spec.upsample_rates):
            raise ValueError(f"upsample rates {spec.upsample_rates} must be even to give exactly T*hop samples")
        self.spec = spec
        self.quantizer = CodebookSum(spec.num_codebooks, spec.codebook_size, spec.codebook_dim)
        with warnings.catch_warnings():  # dac's WNConv1d uses the old weight_norm: its weight_g/weight_v
            warnings.filterwarnings("ignore", message=r".*weight_norm.*deprecated", category=FutureWarning)
            self.decoder = WaveDecoder(
                spec.codebook_dim, spec.decoder_channels, spec.upsample_rates, spec.audio_channels
            )  # keys are the ones Khala's checkpoint has

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.quantizer(codes))[0]


# ---------------------------------------------------------------------------------------------- loading


def _read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's contents, read without running anything it pickled (a .ckpt is untrusted input; a
    real Lightning one holds hyper-parameters, callbacks and loop states besides the weights: safe_pickle),
    memory-mapped (real ones hold GBs of encoder/discriminator/optimizer state we never touch)."""
    if not path.is_file():
        raise CodecLoadError(f"codec checkpoint not found: {path}")
    try:
        ckpt = safe_pickle.load_inert(path)
    except Exception as exc:  # corrupt zip, truncated file, not a torch file
        raise CodecLoadError(f"{path}: not a readable torch checkpoint ({exc})") from exc
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise CodecLoadError(f"{path}: expected a Lightning-style checkpoint with a 'state_dict' dict")
    return ckpt


def _decoder_state(raw: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """Keep `generator.` keys, strip the prefix, drop the encoder and the RVQ wrappers' copies."""
    generator = {k[len(GENERATOR_PREFIX) :]: v for k, v in raw.items() if k.startswith(GENERATOR_PREFIX)}
    if not generator:
        raise CodecLoadError(f"{path}: no '{GENERATOR_PREFIX}' keys in state_dict (first keys: {sorted(raw)[:5]})")
    not_tensors = sorted(k for k, v in generator.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise CodecLoadError(f"{path}: state_dict entries that are not tensors: {_list(set(not_tensors))}")
    for key, value in generator.items():
        alias = _LAYER_ALIAS.match(key)
        own = f"quantizer.embed_{alias.group(1)}" if alias else None
        if own in generator and not torch.equal(value, generator[own]):
            raise CodecLoadError(f"{path}: {GENERATOR_PREFIX}{key} differs from {GENERATOR_PREFIX}{own}")
    return {k: v for k, v in generator.items() if not _UNUSED_GENERATOR_KEY.match(k)}


def _list(keys: set[str], limit: int = 8) -> str:
    names = sorted(keys)
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(GENERATOR_PREFIX + k for k in names[:limit]) + more


def _check_keys(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """Strict match with an error that names what is wrong (load_state_dict's is hard to read)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    problems = []
    if missing:
        problems.append(f"missing keys: {_list(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_list(unexpected)}")
    wrong = [
        f"{GENERATOR_PREFIX}{k} {tuple(state[k].shape)} != {shape}"
        for k, shape in sorted(expected.items())
        if k in state and tuple(state[k].shape) != shape
    ]
    if wrong:
        problems.append("shape mismatches (checkpoint != profile): " + "; ".join(wrong[:8]))
    if problems:
        raise CodecLoadError(f"{path} does not fit this codec profile: " + " | ".join(problems))


def load_codec(spec: CodecSpec, path: str | os.PathLike, device: str | torch.device = "cpu") -> KhalaCodecDecoder:
    """Build the decoder for `spec` and fill it from a Lightning-style Khala codec .ckpt."""
    path = Path(path)
    state = _decoder_state(_read_checkpoint(path)["state_dict"], path)
    with torch.device("meta"):  # skip random init: ~4 s for the 178 M-parameter real decoder
        model = KhalaCodecDecoder(spec)
    _check_keys(model, state, path)
    state = {k: v.to(device=device, dtype=torch.float32, copy=True) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------- tiny


def random_decoder(spec: CodecSpec, seed: int) -> KhalaCodecDecoder:
    """A decoder of `spec` with deterministic random weights (codebooks N(0, 1/64) so their sum stays ~1)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = KhalaCodecDecoder(spec)
        for i in range(spec.num_codebooks):
            nn.init.normal_(getattr(model.quantizer, f"embed_{i}"), std=1.0 / math.sqrt(spec.num_codebooks))
    return model.eval().requires_grad_(False)


def write_tiny_codec(spec: CodecSpec, path: str | os.PathLike, seed: int = 0) -> KhalaCodecDecoder:
    """Write a random-weight codec in the real checkpoint's format; return the model it holds.

    Besides the decoder it writes what a real training .ckpt carries (encoder, RVQ layer wrappers with EMA
    state, a discriminator, counters), so tests exercise the loader's filtering.
    """
    model = random_decoder(spec, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    state: dict[str, torch.Tensor] = {GENERATOR_PREFIX + k: v for k, v in model.state_dict().items()}
    for i in range(spec.num_codebooks):
        embed = getattr(model.quantizer, f"embed_{i}").detach()
        layer = f"{GENERATOR_PREFIX}quantizer.vq_layer_{i}._codebook."
        state[layer + "embed"] = embed  # same storage, as in DacRVQ (saved once)
        state[layer + "embed_avg"] = embed.clone()
        state[layer + "cluster_size"] = torch.rand(spec.codebook_size, generator=gen)
        state[layer + "inited"] = torch.ones(1)
    state[GENERATOR_PREFIX + "encoder.block.0.weight_v"] = torch.randn(8, spec.audio_channels, 7, generator=gen)
    state[GENERATOR_PREFIX + "encoder.block.0.weight_g"] = torch.ones(8, 1, 1)
    state[GENERATOR_PREFIX + "encoder.block.0.bias"] = torch.zeros(8)
    state["discriminator.convs.0.weight"] = torch.randn(4, 1, 3, generator=gen)
    ckpt = {
        "epoch": 3,
        "global_step": 2_490_000,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": state,
        # what Lightning's trainer adds (plain types here; tests add pickled objects of other classes)
        "hparams_name": "kwargs",
        "hyper_parameters": {
            "sample_rate": spec.sample_rate,
            "n_codebooks": spec.num_codebooks,
            "codebook_size": spec.codebook_size,
        },
        "callbacks": {
            "ModelCheckpoint{'monitor': None, 'mode': 'min'}": {
                "best_model_score": torch.tensor(0.25),
                "best_model_path": "/ckpt/dac_rvq_2490000.ckpt",
            }
        },
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 4, "completed": 3}}}},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 1e-4, "betas": (0.8, 0.99)}]}],
        "lr_schedulers": [{"gamma": 0.999996, "last_epoch": 2_490_000}],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(ckpt, tmp)
    os.replace(tmp, path)
    return model


# ---------------------------------------------------------------------------------------------- decoding


def plan_chunks(num_frames: int, chunk_frames: int, overlap_frames: int) -> list[tuple[int, int]]:
    """[start, end) frame ranges: full chunks `chunk - overlap` apart, the last one cut at the end.

    Every chunk but the first overlaps its predecessor by exactly `overlap_frames`, and the last one
    still reaches past that overlap, so each seam is a full-length crossfade.
    """
    if not 0 <= overlap_frames < chunk_frames:
        raise ValueError(f"need 0 <= overlap ({overlap_frames}) < chunk ({chunk_frames})")
    if num_frames <= chunk_frames:
        return [(0, num_frames)]
    stride = chunk_frames - overlap_frames
    count = 1 + math.ceil((num_frames - chunk_frames) / stride)
    return [(k * stride, min(k * stride + chunk_frames, num_frames)) for k in range(count)]


def fade_in(num_samples: int) -> torch.Tensor:
    """Linear crossfade weight of the incoming chunk, (j + 0.5) / n: symmetric, weights sum to 1."""
    return (torch.arange(num_samples, dtype=torch.float32) + 0.5) / num_samples


def _check_codes(codes: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """Reject bad codes here: an out-of-range index on a GPU is an opaque device-side assert."""
    if codes.dim() != 2 or codes.shape[0] != spec.num_codebooks or codes.shape[1] < 1:
        raise ValueError(f"codes must be [{spec.num_codebooks}, frames>=1], got {list(codes.shape)}")
    if codes.is_floating_point() or codes.is_complex():
        raise ValueError(f"codes must be integers, got {codes.dtype}")
    low, high = int(codes.min()), int(codes.max())
    if low < 0 or high >= spec.codebook_size:
        raise ValueError(f"codes must lie in [0, {spec.codebook_size}), got [{low}, {high}]")
    return codes.long()


def decode_codes(decoder: KhalaCodecDecoder, codes: torch.Tensor, control: StageControl | None = None) -> torch.Tensor:
    """codes [num_codebooks, F] -> float32 CPU audio [audio_channels, F * hop].

    Decodes `chunk_frames` at a time so activation memory does not grow with the song, and blends the
    `overlap_frames` shared by neighbouring chunks with a linear crossfade, which hides each chunk's
    zero-padded edges.
    """
    control = control or StageControl()
    spec = decoder.spec
    codes = _check_codes(codes, spec)
    hop, num_frames = spec.hop_length, codes.shape[1]
    chunks = plan_chunks(num_frames, spec.chunk_frames, spec.overlap_frames)
    device = next(decoder.parameters()).device
    out = torch.empty(spec.audio_channels, num_frames * hop)
    ramp = fade_in(spec.overlap_frames * hop)
    control.check()
    for k, (start, end) in enumerate(chunks):
        with torch.inference_mode():
            audio = decoder(codes[:, start:end].to(device)).float().cpu()
        blend = 0 if k == 0 else ramp.numel()  # the previous chunk wrote exactly these samples
        lo = start * hop
        if blend:
            out[:, lo : lo + blend].lerp_(audio[:, :blend], ramp)
        out[:, lo + blend : end * hop] = audio[:, blend:]
        del audio
        control.step(k + 1, len(chunks), "chunks")
    return out
