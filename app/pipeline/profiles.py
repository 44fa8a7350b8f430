"""Model profiles: the sizes and file locations of every model a music job uses.

`tiny` has random weights written by `python -m app.pipeline.tiny` in the same on-disk formats as the real
checkpoints (its audio is noise); `khala` points at real checkpoints. Loaders are the same code for both.
Audio-token id offsets derive from these numbers, never from literals in stage code.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SAMPLE_RATE = 44100
HOP_LENGTH = 2048
NUM_CODEBOOKS = 64
COARSE_CODEBOOKS = 2  # the backbone writes q0 and q1; super-resolution fills the rest


@dataclass(frozen=True)
class TransformerSpec:
    """Shape of a Khala-style decoder (Llama-like: GQA, RoPE, RMSNorm, SwiGLU with linear bias)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    max_sequence_length: int
    rotary_base: int = 500_000
    norm_epsilon: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class CodecSpec:
    """Stereo 44.1 kHz RVQ codec decoder: 64 codebooks summed, DAC-style upsampling blocks, no tanh."""

    codebook_size: int
    codebook_dim: int
    decoder_channels: int
    upsample_rates: tuple[int, ...] = (8, 8, 8, 4)
    num_codebooks: int = NUM_CODEBOOKS
    audio_channels: int = 2
    sample_rate: int = SAMPLE_RATE
    chunk_frames: int = 1920
    overlap_frames: int = 480

    @property
    def hop_length(self) -> int:
        hop = 1
        for rate in self.upsample_rates:
            hop *= rate
        return hop


@dataclass(frozen=True)
class MusicProfile:
    name: str
    text_vocab_size: int  # first audio token id: audio tokens follow the text vocabulary
    codebook_size: int
    backbone: TransformerSpec
    superres: TransformerSpec
    codec: CodecSpec
    model_dir: Path
    min_duration_s: float
    max_duration_s: float
    default_duration_s: float
    backbone_top_k: int = 80
    superres_top_k: int = 10
    tokenizer_subdir: str = "tokenizer"
    backbone_subdir: str = "backbone"
    superres_subdir: str = "superres"
    codec_file: str = "codec/codec.ckpt"

    def audio_token_offset(self, codebook: int) -> int:
        """Id of entry 0 of `codebook` (q0 at text_vocab_size, q1 right after, ...)."""
        return self.text_vocab_size + codebook * self.codebook_size

    @property
    def frames_per_second(self) -> float:
        return self.codec.sample_rate / self.codec.hop_length

    def frames_for(self, duration_s: float) -> int:
        return max(1, round(duration_s * self.frames_per_second))

    @property
    def tokenizer_dir(self) -> Path:
        return self.model_dir / self.tokenizer_subdir

    @property
    def backbone_dir(self) -> Path:
        return self.model_dir / self.backbone_subdir

    @property
    def superres_dir(self) -> Path:
        return self.model_dir / self.superres_subdir

    @property
    def codec_path(self) -> Path:
        return self.model_dir / self.codec_file


def _tiny(model_dir: Path) -> MusicProfile:
    text_vocab, codebook_size = 512, 32
    def transformer(vocab: int) -> TransformerSpec:
        return TransformerSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=176, vocab_size=vocab, max_sequence_length=8192)
    return MusicProfile(
        name="tiny", text_vocab_size=text_vocab, codebook_size=codebook_size,
        backbone=transformer(text_vocab + COARSE_CODEBOOKS * codebook_size),
        superres=transformer(text_vocab + NUM_CODEBOOKS * codebook_size),
        codec=CodecSpec(codebook_size=codebook_size, codebook_dim=16, decoder_channels=32,
                        chunk_frames=64, overlap_frames=16),
        model_dir=model_dir, min_duration_s=1.0, max_duration_s=600.0, default_duration_s=5.0,
    )


def _khala(model_dir: Path) -> MusicProfile:
    text_vocab, codebook_size = 128_256, 1024
    def transformer(vocab: int) -> TransformerSpec:
        return TransformerSpec(num_layers=24, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
                               ffn_hidden_size=5632, vocab_size=vocab, max_sequence_length=32768)
    return MusicProfile(
        name="khala", text_vocab_size=text_vocab, codebook_size=codebook_size,
        backbone=transformer(130_432),  # 130304 padded to a multiple of 128
        superres=transformer(text_vocab + NUM_CODEBOOKS * codebook_size),
        codec=CodecSpec(codebook_size=codebook_size, codebook_dim=128, decoder_channels=3072),
        model_dir=model_dir, min_duration_s=60.0, max_duration_s=600.0, default_duration_s=120.0,
    )


PROFILES = {"tiny": _tiny, "khala": _khala}


def load_profile(name: str, model_dir: str | os.PathLike | None = None) -> MusicProfile:
    """Profile `name` with its files under `model_dir` (default: ./models/<name>)."""
    if name not in PROFILES:
        raise ValueError(f"unknown music profile {name!r}; choose one of {sorted(PROFILES)}")
    return PROFILES[name](Path(model_dir) if model_dir else Path("models") / name)


@dataclass(frozen=True)
class LipsyncProfile:
    """MuseTalk v1.5 file layout under `model_dir`; sizes come from the config files inside it."""

    name: str
    model_dir: Path
    crop_size: int = 256
    audio_padding_left: int = 2   # whisper feature frames around each video frame (MuseTalk v1.5)
    audio_padding_right: int = 2
    default_fps: float = 25.0
    default_batch_size: int = 8
    default_extra_margin: int = 10

    @property
    def unet_path(self) -> Path:
        return self.model_dir / "musetalkV15" / "unet.pth"

    @property
    def unet_config_path(self) -> Path:
        return self.model_dir / "musetalkV15" / "musetalk.json"

    @property
    def vae_dir(self) -> Path:
        return self.model_dir / "sd-vae"

    @property
    def whisper_dir(self) -> Path:
        return self.model_dir / "whisper"


LIPSYNC_PROFILES = {"tiny": dict(default_batch_size=4), "musetalk": {}}


def load_lipsync_profile(name: str, model_dir: str | os.PathLike | None = None) -> LipsyncProfile:
    """Lip-sync profile `name` with its files under `model_dir` (default: ./models/lipsync-<name>)."""
    if name not in LIPSYNC_PROFILES:
        raise ValueError(f"unknown lip-sync profile {name!r}; choose one of {sorted(LIPSYNC_PROFILES)}")
    directory = Path(model_dir) if model_dir else Path("models") / f"lipsync-{name}"
    return LipsyncProfile(name=name, model_dir=directory, **LIPSYNC_PROFILES[name])
