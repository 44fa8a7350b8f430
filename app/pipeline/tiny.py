"""Write the tiny profile's random-weight models in the real on-disk formats:
  <dir>/tokenizer/        PreTrainedTokenizerFast directory (Llama-3 special-token layout, small vocab)
  <dir>/backbone/         Megatron torch_dist checkpoint (causal GPT)
  <dir>/superres/         Megatron torch_dist checkpoint (bidirectional GPT)
  <dir>/codec/codec.ckpt  Lightning-style checkpoint with `generator.`-prefixed keys
and the tiny MuseTalk v1.5 models in MuseTalk's layout under <lipsync dir> (musetalkV15/, sd-vae/, whisper/).
The loaders that read these are the ones that read real checkpoints. Their audio and video are noise.

    python -m app.pipeline.tiny [--out models/tiny] [--lipsync-out models/lipsync-tiny] [--seed 1234] [--force]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.pipeline.profiles import load_lipsync_profile, load_profile

MARKER = ".complete"


def write_tiny_models(out: Path, seed: int = 1234, force: bool = False, profile_name: str = "tiny") -> Path:
    """Write every model of a random-weight profile (`tiny`, or `shaped`: bench/throughput.py's) under `out`
    (skipped when a previous run completed with the same seed and shapes, unless `force`)."""
    profile = load_profile(profile_name, out)
    # a changed shape (of any of the three models) rewrites them all
    written = f"seed={seed}\nbackbone={profile.backbone}\nsuperres={profile.superres}\ncodec={profile.codec}\n"
    if (out / MARKER).exists() and (out / MARKER).read_text() == written and not force:
        return out
    from app.pipeline.music import codec, megatron_backend, prompt

    out.mkdir(parents=True, exist_ok=True)
    prompt.write_tiny_tokenizer(profile, profile.tokenizer_dir)
    megatron_backend.write_tiny_checkpoint(profile.backbone, profile.backbone_dir, causal=True, seed=seed)
    megatron_backend.write_tiny_checkpoint(profile.superres, profile.superres_dir, causal=False, seed=seed + 1)
    profile.codec_path.parent.mkdir(parents=True, exist_ok=True)
    codec.write_tiny_codec(profile.codec, profile.codec_path, seed=seed + 2)
    (out / MARKER).write_text(written)
    return out


def write_tiny_lipsync_models(out: Path, seed: int = 1234, force: bool = False, profile_name: str = "tiny") -> Path:
    """Write the random-weight MuseTalk models of `profile_name` (`tiny`, or `shaped`: bench/throughput.py's) under
    `out` (skipped when a previous run completed with the same seed and profile, unless `force`)."""
    written = f"seed={seed}\n" + (f"profile={profile_name}\n" if profile_name != "tiny" else "")
    if (out / MARKER).exists() and (out / MARKER).read_text() == written and not force:
        return out
    from app.pipeline.lipsync import musetalk

    out.mkdir(parents=True, exist_ok=True)
    musetalk.write_tiny_musetalk(load_lipsync_profile(profile_name, out), seed=seed)
    (out / MARKER).write_text(written)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("models/tiny"))
    parser.add_argument("--lipsync-out", type=Path, default=Path("models/lipsync-tiny"))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--force", action="store_true", help="rewrite even if already complete")
    args = parser.parse_args(argv)
    music = write_tiny_models(args.out, args.seed, args.force)
    lipsync = write_tiny_lipsync_models(args.lipsync_out, args.seed, args.force)
    print(f"tiny models in {music} (music) and {lipsync} (lip-sync)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
