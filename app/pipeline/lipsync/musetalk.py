"""MuseTalk v1.5 models, loaded from the layout `LipsyncProfile` names (public repo TMElyralab/MuseTalk):

  musetalkV15/musetalk.json  diffusers UNet2DConditionModel config (in 8 = masked + reference latents,
                             out 4, cross_attention_dim = whisper d_model 384)
  musetalkV15/unet.pth       torch.save(unet.state_dict()): bare diffusers keys ("conv_in.weight", ...),
                             loaded strictly (musetalk/models/unet.py: model.load_state_dict(weights))
  sd-vae/                    diffusers AutoencoderKL directory (sd-vae-ft-mse: config.json +
                             diffusion_pytorch_model.bin)
  whisper/                   transformers whisper-tiny (config.json, pytorch_model.bin with "model."-prefixed
                             keys, preprocessor_config.json); only the encoder is kept

`write_tiny_musetalk` writes random-weight models in exactly that layout so `load_musetalk` is the same code
for tests and for the real checkpoints. Everything is read from local files; nothing is downloaded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

# From diffusers.models, not diffusers: the top level's type-checking imports name the placeholder classes it
# exports when torch is missing, which have none of the models' attributes.
from diffusers.models import AutoencoderKL, UNet2DConditionModel
from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration, WhisperModel
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from app.pipeline.profiles import LipsyncProfile

WHISPER_SAMPLE_RATE = 16_000
WHISPER_FEATURE_RATE = 50  # encoder frames per second of audio (20 ms each)
WHISPER_WINDOW_S = 30  # whisper encodes fixed 30 s windows (3000 mel frames -> 1500 encoder frames)
UNET_TIMESTEP = 0  # MuseTalk is single-step inpainting at t = 0


@dataclass
class MuseTalkModels:
    """Everything one lip-sync job needs, already on `device` in `dtype` and in eval mode."""

    unet: UNet2DConditionModel
    vae: AutoencoderKL
    whisper: WhisperEncoder
    feature_extractor: WhisperFeatureExtractor
    device: torch.device
    dtype: torch.dtype
    crop_size: int = 256
    _position_table: torch.Tensor | None = field(default=None, repr=False)

    @property
    def scaling_factor(self) -> float:
        """sd-vae-ft-mse has no scaling_factor in its config; diffusers' default 0.18215 is what MuseTalk uses."""
        return float(self.vae.config["scaling_factor"])

    @property
    def audio_dim(self) -> int:
        return int(self.whisper.config.d_model)

    @property
    def audio_layers(self) -> int:
        """Hidden states per whisper frame: the embedding output plus one per encoder layer."""
        return int(self.whisper.config.encoder_layers) + 1

    def positional_encoding(self, length: int) -> torch.Tensor:
        """[length, audio_dim] sinusoidal table that MuseTalk adds to the audio prompt before the UNet
        (musetalk/models/unet.py PositionalEncoding, applied as `pe(whisper_batch)` in scripts/inference.py)."""
        if self._position_table is None or self._position_table.shape[0] < length:
            table = sinusoidal_table(max(length, 64), self.audio_dim)
            self._position_table = table.to(device=self.device, dtype=self.dtype)
        return self._position_table[:length]


def sinusoidal_table(length: int, dim: int) -> torch.Tensor:
    """Transformer sin/cos position table: even columns sin, odd columns cos, base 10000."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(position * div)
    table[:, 1::2] = torch.cos(position * div)
    return table


PRECISIONS = {"fp16": torch.float16, "fp32": torch.float32}


def model_dtype(device: torch.device) -> torch.dtype:
    """fp16 on CUDA (MuseTalk's --use_float16), fp32 on CPU where half kernels are slow or missing."""
    return torch.float16 if device.type == "cuda" else torch.float32


def precision_name(dtype: torch.dtype) -> str:
    """ "fp16" / "fp32" for a model dtype, as ENCORE_LIPSYNC_PRECISION spells it (recorded in stage info)."""
    return next((name for name, known in PRECISIONS.items() if known == dtype), str(dtype))


class PrecisionUnsupported(RuntimeError):
    """The asked precision cannot run on the device (raised at load, before any frame is processed)."""


def _half_kernels_error(device: torch.device) -> str | None:
    """Run the op kinds the UNet, VAE and whisper use (conv, group/layer norm, attention, upsampling, GELU,
    SiLU) at fp16 on a few numbers; the error text if one has no fp16 kernel on `device`, else None."""
    try:
        x = torch.randn(1, 8, 4, 4, device=device, dtype=torch.float16)
        x = torch.nn.functional.conv2d(x, torch.randn(8, 8, 3, 3, device=device, dtype=x.dtype), padding=1)
        x = torch.nn.functional.silu(torch.nn.functional.group_norm(x, 4))
        x = torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
        tokens = torch.nn.functional.layer_norm(x.flatten(2).transpose(1, 2), (8,))
        tokens = torch.nn.functional.scaled_dot_product_attention(tokens, tokens, tokens)
        tokens = torch.nn.functional.gelu(
            torch.nn.functional.conv1d(
                tokens.transpose(1, 2), torch.randn(8, 8, 3, device=device, dtype=x.dtype), padding=1
            )
        )
        if not torch.isfinite(tokens).all():
            return "fp16 arithmetic gave non-finite values"
    except (RuntimeError, NotImplementedError) as error:
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return None


def resolve_dtype(device: torch.device, precision: str = "auto") -> torch.dtype:
    """The dtype MuseTalk runs in for ENCORE_LIPSYNC_PRECISION on `device`.

    auto: `model_dtype` (fp16 on CUDA, fp32 on CPU). fp32: always. fp16: on CUDA always; on a CPU only if
    its half kernels work. Torch 2.13's CPU build runs the tiny UNet + VAE + whisper forward in fp16 with
    finite output, about 2x slower than fp32 (2 cores), so fp16 on a CPU is honoured (useful to check fp16
    numerics without a GPU) after a probe of the op kinds the models use; a build or device lacking one
    fails here, at load, with PrecisionUnsupported naming the setting, rather than mid-job.
    """
    if precision == "auto":
        return model_dtype(device)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be auto, fp16 or fp32, not {precision!r}")
    if precision == "fp16" and device.type != "cuda":
        error = _half_kernels_error(device)
        if error is not None:
            raise PrecisionUnsupported(
                f"ENCORE_LIPSYNC_PRECISION=fp16 is not supported on {device} by torch "
                f"{torch.__version__}: {error}; use fp32 or auto"
            )
    return PRECISIONS[precision]


def load_unet(profile: LipsyncProfile, device: torch.device, dtype: torch.dtype) -> UNet2DConditionModel:
    """Build the UNet from musetalk.json and load unet.pth strictly, as MuseTalk does.

    The module is built on the meta device so the ~3.4 GB real checkpoint is not preceded by a random init.
    """
    config = json.loads(profile.unet_config_path.read_text())
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    state = torch.load(profile.unet_path, map_location="cpu", weights_only=True)
    unet.load_state_dict({key: value.to(dtype) for key, value in state.items()}, strict=True, assign=True)
    return unet.to(device).eval().requires_grad_(False)


def load_vae(profile: LipsyncProfile, device: torch.device, dtype: torch.dtype) -> AutoencoderKL:
    vae = AutoencoderKL.from_pretrained(profile.vae_dir, local_files_only=True, torch_dtype=dtype)
    return vae.to(device).eval().requires_grad_(False)


def load_whisper(
    profile: LipsyncProfile, device: torch.device, dtype: torch.dtype
) -> tuple[WhisperEncoder, WhisperFeatureExtractor]:
    """Whisper encoder + its mel front end; the decoder is dropped because MuseTalk never runs it."""
    whisper = WhisperModel.from_pretrained(profile.whisper_dir, local_files_only=True)
    encoder = whisper.get_encoder()
    del whisper
    encoder = encoder.to(device=device, dtype=dtype).eval().requires_grad_(False)
    extractor = WhisperFeatureExtractor.from_pretrained(profile.whisper_dir, local_files_only=True)
    return encoder, extractor


def vae_identity(profile: LipsyncProfile) -> str:
    """Names, sizes and modification times of the VAE's files: part of the source cache's key for latents,
    so new VAE weights never meet latents of the old ones."""
    files = sorted(path for path in profile.vae_dir.rglob("*") if path.is_file())
    return ";".join(f"{path.name}:{path.stat().st_size}:{path.stat().st_mtime_ns}" for path in files)


def load_musetalk(profile: LipsyncProfile, device: str | torch.device, *, precision: str = "auto") -> MuseTalkModels:
    """Load UNet, VAE and whisper from `profile.model_dir` (local files only) in `precision` (resolve_dtype)."""
    device = torch.device(device)
    dtype = resolve_dtype(device, precision)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes per batch (inference pads the last one)
    for path in (profile.unet_path, profile.unet_config_path, profile.vae_dir, profile.whisper_dir):
        if not path.exists():
            raise FileNotFoundError(f"MuseTalk file missing: {path}")
    encoder, extractor = load_whisper(profile, device, dtype)
    unet = load_unet(profile, device, dtype)
    if unet.config["cross_attention_dim"] != encoder.config.d_model:
        raise ValueError(
            f"UNet cross_attention_dim {unet.config['cross_attention_dim']} != whisper d_model {encoder.config.d_model}"
        )
    return MuseTalkModels(
        unet=unet,
        vae=load_vae(profile, device, dtype),
        whisper=encoder,
        feature_extractor=extractor,
        device=device,
        dtype=dtype,
        crop_size=profile.crop_size,
    )


# -- tiny random-weight models in the real layout ---------------------------------------------------------

TINY_WHISPER = dict(
    d_model=64,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_layers=1,
    decoder_attention_heads=4,
    decoder_ffn_dim=128,
    num_mel_bins=80,
    max_source_positions=1500,
    max_target_positions=32,
    vocab_size=64,
    pad_token_id=63,
    bos_token_id=63,
    eos_token_id=63,
    decoder_start_token_id=63,
    suppress_tokens=[],
    begin_suppress_tokens=[],
)


def tiny_unet_config(cross_attention_dim: int) -> dict:
    """musetalk.json's fields with small widths (real: block_out_channels [320, 640, 1280, 1280], 2 layers)."""
    return {
        "_class_name": "UNet2DConditionModel",
        "_diffusers_version": "0.6.0.dev0",
        "act_fn": "silu",
        "attention_head_dim": 8,
        "block_out_channels": [32, 64],
        "center_input_sample": False,
        "cross_attention_dim": cross_attention_dim,
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "downsample_padding": 1,
        "flip_sin_to_cos": True,
        "freq_shift": 0,
        "in_channels": 8,
        "layers_per_block": 1,
        "mid_block_scale_factor": 1,
        "norm_eps": 1e-05,
        "norm_num_groups": 32,
        "out_channels": 4,
        "sample_size": 32,
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    }


def tiny_vae() -> AutoencoderKL:
    """sd-vae-ft-mse's structure (4 blocks, 3 downsamples = 8x, 4 latent channels) with small widths."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=256,
    )


# MuseTalk v1.5's real sizes (musetalk.json; sd-vae-ft-mse; whisper-tiny), for random-weight checkpoints in
# the real layout at full size: benchmarks (bench/gpu_lipsync.py) measure speed with them; their output is noise.
REAL_UNET = dict(
    block_out_channels=[320, 640, 1280, 1280],
    layers_per_block=2,
    sample_size=64,
    down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
)
# The `shaped` profile (bench/throughput.py --profile shaped): the tiny UNet with one attention head over its 32
# channels, near MuseTalk's own head width (320 channels / 8 heads = 40). The tiny config splits them into 8 heads of
# 4 (diffusers reads `attention_head_dim` as the head count), a width no real model has, at which a CPU's attention
# kernel runs at a fraction of its speed: the tiny lip-sync then weighs about twice as much beside the shaped songs
# as a real one does beside real songs on an H200 (bench/stage_shares.py measures both; docs/performance.md).
SHAPED_UNET = dict(attention_head_dim=1)
REAL_VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32)
WHISPER_TINY = dict(
    d_model=384,
    encoder_layers=4,
    encoder_attention_heads=6,
    encoder_ffn_dim=1536,
    decoder_layers=4,
    decoder_attention_heads=6,
    decoder_ffn_dim=1536,
    num_mel_bins=80,
    max_source_positions=1500,
    max_target_positions=448,
    vocab_size=51865,
)


def write_tiny_musetalk(profile: LipsyncProfile, seed: int = 0) -> Path:
    """Write random-weight UNet, VAE and whisper under `profile.model_dir`; deterministic by `seed`."""
    return write_random_musetalk(profile, seed=seed)


def write_random_musetalk(
    profile: LipsyncProfile, seed: int = 0, *, real_size: bool = False, dtype: torch.dtype = torch.float32
) -> Path:
    """Random-weight MuseTalk files in the real layout: the tiny sizes (the `shaped` profile's UNet with its
    SHAPED_UNET head), or with `real_size` MuseTalk v1.5's (an 850 M-parameter UNet; stored in `dtype`, the loader
    casts to the run's precision)."""
    profile.unet_path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    whisper_config = WhisperConfig(**(WHISPER_TINY if real_size else TINY_WHISPER))
    whisper = WhisperForConditionalGeneration(whisper_config)
    # HF hub files store the tied output projection once, under the embedding's name.
    whisper_state = {k: v.to(dtype) for k, v in whisper.state_dict().items() if k != "proj_out.weight"}
    profile.whisper_dir.mkdir(parents=True, exist_ok=True)
    whisper_config.save_pretrained(profile.whisper_dir)
    torch.save(whisper_state, profile.whisper_dir / "pytorch_model.bin")
    WhisperFeatureExtractor(
        feature_size=whisper_config.num_mel_bins, sampling_rate=WHISPER_SAMPLE_RATE
    ).save_pretrained(profile.whisper_dir)
    del whisper, whisper_state

    torch.manual_seed(seed + 1)
    sizes = REAL_UNET if real_size else SHAPED_UNET if profile.name == "shaped" else {}
    config = {**tiny_unet_config(whisper_config.d_model), **sizes}
    unet = UNet2DConditionModel.from_config(config)
    profile.unet_config_path.write_text(json.dumps(config, indent=2) + "\n")
    torch.save({k: v.to(dtype) for k, v in unet.state_dict().items()}, profile.unet_path)
    del unet

    torch.manual_seed(seed + 2)
    vae = (
        tiny_vae()
        if not real_size
        else AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4,
            latent_channels=4,
            sample_size=256,
            **REAL_VAE,
        )
    )
    # diffusers wraps ModelMixin.to with functools.wraps, which typeshed types as a callable attribute rather than
    # a method, so the checker takes `dtype` for `self`.
    vae.to(dtype).save_pretrained(profile.vae_dir, safe_serialization=False)  # type: ignore[arg-type]
    return profile.model_dir
