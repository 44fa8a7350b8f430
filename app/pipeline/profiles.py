"""Model profiles: the sizes and file locations of every model a music job uses.

`tiny` has random weights written by `python -m app.pipeline.tiny` in the same on-disk formats as the real
checkpoints (its audio is noise); `khala` points at real checkpoints. Loaders are the same code for both.
Audio-token id offsets derive from these numbers, never from literals in stage code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
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
    kv_channels: int | None = None  # per-head size; None: Megatron's default, hidden / heads

    def __post_init__(self) -> None:
        if self.kv_channels is None:  # stored resolved, so that equal shapes compare equal
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        assert self.kv_channels is not None, "__post_init__ resolves it"
        return self.kv_channels


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
    # "model": the backbone may sample end-of-text and the song ends where the model ends it (Khala);
    # "duration": exactly the requested number of frames, never end-of-text (random weights would end at random).
    song_end: str = "model"
    max_generated_tokens: int = 23_552  # Khala's --num-tokens-to-generate
    superres_max_prompt_tokens: int = 2048  # Khala clamps super-resolution prompts to this length
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
    def longest_song_s(self) -> float:
        """The longest song the backbone can write: its generated-token cap, in whole seconds."""
        return float(int(self.max_generated_tokens / COARSE_CODEBOOKS / self.frames_per_second))

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
        """The codec checkpoint; a `*` in `codec_file` picks the newest training step among the matches
        (Khala ships `dac_rvq_<step>.ckpt`)."""
        if "*" not in self.codec_file:
            return self.model_dir / self.codec_file
        matches = sorted(self.model_dir.glob(self.codec_file), key=_training_step)
        return matches[-1] if matches else self.model_dir / self.codec_file


# Positions the backbone's KV cache holds (Khala's --inference-max-seq-length); the super-resolution model sees
# a prompt of at most 2048 tokens plus one position per frame.
BACKBONE_MAX_POSITIONS = 25_600
SUPERRES_MAX_POSITIONS = 32_768


def _vocab_sizes(text_vocab: int, codebook_size: int) -> tuple[int, int]:
    """Backbone and super-resolution vocabularies as the reference builds them: the text ids, then the id
    windows of the codebooks each model writes, unpadded (Khala sets padded_vocab_size to exactly these)."""
    return text_vocab + COARSE_CODEBOOKS * codebook_size, text_vocab + NUM_CODEBOOKS * codebook_size


def _tiny(model_dir: Path) -> MusicProfile:
    """Random weights: `song_end="duration"` keeps every song at its requested length (docs/models.md)."""
    text_vocab, codebook_size = 512, 32
    backbone_vocab, superres_vocab = _vocab_sizes(text_vocab, codebook_size)

    def transformer(vocab: int, positions: int) -> TransformerSpec:
        return TransformerSpec(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=176,
            vocab_size=vocab,
            max_sequence_length=positions,
        )

    profile = MusicProfile(
        name="tiny",
        text_vocab_size=text_vocab,
        codebook_size=codebook_size,
        backbone=transformer(backbone_vocab, BACKBONE_MAX_POSITIONS),
        superres=transformer(superres_vocab, SUPERRES_MAX_POSITIONS),
        codec=CodecSpec(
            codebook_size=codebook_size, codebook_dim=16, decoder_channels=32, chunk_frames=64, overlap_frames=16
        ),
        model_dir=model_dir,
        min_duration_s=1.0,
        max_duration_s=0.0,
        default_duration_s=5.0,
        song_end="duration",
    )
    return replace(profile, max_duration_s=profile.longest_song_s)


def _shaped(model_dir: Path) -> MusicProfile:
    """Random weights, tiny vocabularies and codec, and a backbone shaped so that a CPU meets the two facts of an
    H200 at Khala sizes a scheduler is judged by (docs/performance.md): a song's GPU time splits across stages as
    an H200's does (backbone / super-resolution / codec ~83 / 12 / 5 % here, one torch thread, no engine:
    bench/stage_shares.py; the H200: 87 / 11 / 2 %), and its decode is near memory-bound, so a step of 16 slots
    costs little more than a step of one (here, with the torch engine's oneDNN linears: the batched decoder's step
    10.7 ms at 16 slots against 9.6 at one, and 1.97x the reference loop's 1-row step; the H200's target is <= 2x;
    with MKL's products, before, 3.5x).
    Wide and shallow for that: 2 layers of width 1024 (~75 MB of fp32 weights, read from memory at every step);
    super-resolution twice the tiny width (128), for its ~10 %. The shares depend on the CPU (the backbone's
    products against the small stages' per-op costs): measure them again on another machine.
    The CPU profile a scheduler is measured with (bench/throughput.py --profile shaped). Its audio is noise."""
    tiny = _tiny(model_dir)
    backbone = replace(
        tiny.backbone, num_layers=2, hidden_size=1024, num_attention_heads=16, num_query_groups=4, ffn_hidden_size=2816
    )
    superres = replace(
        tiny.superres, hidden_size=128, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=352, kv_channels=None
    )
    return replace(tiny, name="shaped", backbone=backbone, superres=superres)


def _khala(model_dir: Path) -> MusicProfile:
    """The real models, in the layout the reference ships (a Khala checkout with its checkpoints/ downloaded):
    models/Tokenizer/, checkpoints/backbone/, checkpoints/superresolution/, checkpoints/dac_rvq_*.ckpt."""
    text_vocab, codebook_size = 128_256, 1024
    backbone_vocab, superres_vocab = _vocab_sizes(text_vocab, codebook_size)  # 130304, 193792

    def transformer(vocab: int, positions: int) -> TransformerSpec:
        return TransformerSpec(
            num_layers=24,
            hidden_size=2048,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=5632,
            vocab_size=vocab,
            max_sequence_length=positions,
        )

    profile = MusicProfile(
        name="khala",
        text_vocab_size=text_vocab,
        codebook_size=codebook_size,
        backbone=transformer(backbone_vocab, BACKBONE_MAX_POSITIONS),
        superres=transformer(superres_vocab, SUPERRES_MAX_POSITIONS),
        codec=CodecSpec(codebook_size=codebook_size, codebook_dim=128, decoder_channels=3072),
        model_dir=model_dir,
        min_duration_s=60.0,
        max_duration_s=0.0,
        default_duration_s=120.0,
        tokenizer_subdir="models/Tokenizer",
        backbone_subdir="checkpoints/backbone",
        superres_subdir="checkpoints/superresolution",
        codec_file="checkpoints/dac_rvq_*.ckpt",
    )
    return replace(profile, max_duration_s=profile.longest_song_s)  # 546 s: 23,552 tokens at 21.53 frames/s


def _training_step(path: Path) -> tuple[int, str]:
    digits = "".join(ch if ch.isdigit() else " " for ch in path.stem).split()
    return (int(digits[-1]) if digits else -1, path.name)


PROFILES = {"tiny": _tiny, "shaped": _shaped, "khala": _khala}


def load_profile(
    name: str, model_dir: str | os.PathLike | None = None, *, song_end: str | None = None, **paths: str
) -> MusicProfile:
    """Profile `name` with its files under `model_dir` (default: ./models/<name>); `paths` override where each
    model lies (tokenizer_subdir, backbone_subdir, superres_subdir, codec_file: absolute or under model_dir),
    `song_end` who ends a song ("model" or "duration")."""
    if name not in PROFILES:
        raise ValueError(f"unknown music profile {name!r}; choose one of {sorted(PROFILES)}")
    unknown = set(paths) - {"tokenizer_subdir", "backbone_subdir", "superres_subdir", "codec_file"}
    if unknown:
        raise ValueError(f"unknown model paths {sorted(unknown)}")
    profile = PROFILES[name](Path(model_dir) if model_dir else Path("models") / name)
    if song_end is not None:
        if song_end not in ("model", "duration"):
            raise ValueError(f"song_end must be 'model' or 'duration', not {song_end!r}")
        profile = replace(profile, song_end=song_end)
    return replace(
        profile,  # by name, so that each field gets a str and a new field is not set by accident
        tokenizer_subdir=paths.get("tokenizer_subdir", profile.tokenizer_subdir),
        backbone_subdir=paths.get("backbone_subdir", profile.backbone_subdir),
        superres_subdir=paths.get("superres_subdir", profile.superres_subdir),
        codec_file=paths.get("codec_file", profile.codec_file),
    )


@dataclass(frozen=True)
class LipsyncProfile:
    """MuseTalk v1.5 file layout under `model_dir`; sizes come from the config files inside it."""

    name: str
    model_dir: Path
    crop_size: int = 256
    audio_padding_left: int = 2  # whisper feature frames around each video frame (MuseTalk v1.5)
    audio_padding_right: int = 2
    default_fps: float = 25.0
    default_batch_size: int = 8  # frames per UNet batch on a CPU, when the request names none
    cuda_batch_size: int = 64  # ... and on CUDA: MuseTalk's size ran 285 frames/s at 64 on an H200, 208 at 32
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


TINY_LIPSYNC_BATCHES = dict(default_batch_size=4, cuda_batch_size=16)
# `shaped`: the tiny files with one attention head in the UNet (musetalk.SHAPED_UNET), for bench/throughput.py
LIPSYNC_PROFILES = {"tiny": TINY_LIPSYNC_BATCHES, "shaped": TINY_LIPSYNC_BATCHES, "musetalk": {}}


def load_lipsync_profile(name: str, model_dir: str | os.PathLike | None = None) -> LipsyncProfile:
    """Lip-sync profile `name` with its files under `model_dir` (default: ./models/lipsync-<name>)."""
    if name not in LIPSYNC_PROFILES:
        raise ValueError(f"unknown lip-sync profile {name!r}; choose one of {sorted(LIPSYNC_PROFILES)}")
    directory = Path(model_dir) if model_dir else Path("models") / f"lipsync-{name}"
    return LipsyncProfile(name=name, model_dir=directory, **LIPSYNC_PROFILES[name])
