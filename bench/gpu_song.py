"""A whole song on one GPU: decode-loop variants, parity, super-resolution, codec, end to end (issue 9).

ONE script for one device call (~8 minutes on an H200 at Khala sizes, random weights), printing JSON lines:
  decode        ms/step early and late in a song for each variant of the backbone's decode loop, 2 tracks:
                megatron (Megatron-core's forward, one track at a time: the in-run baseline), reference_loop
                (backbone.py's loop on the plain-PyTorch engine, host sampling), device_loop (a slot decoder of
                one slot per track, slots.decode_song: no host round trip per token), device_loop_graphs (the
                same, one CUDA graph per frame; CUDA only)
  parity        teacher-forced: the device loop's window-only head against the full head on the same
                tokens (max |diff|, argmax agreement), Megatron against the plain engine, the device loop's
                codes against the reference loop's alone, and eager vs graphs (same seeds)
  superres      62 passes x 2 tracks over the whole song
  codec         both tracks' 64 codebooks to 44.1 kHz stereo
  song_inprocess  the four stages in-process, models resident (keep_loaded), 2 tracks
  song_worker   submission to both MP3s through a real prefork Celery worker (models written to disk first)
Each section runs in its own child process with its own time limit, so one failure does not lose the rest.
The last line is {"summary": {...}} for comparing runs. Ratios to the Megatron baseline are what to read.

    python bench/gpu_song.py [--tiny] [--seconds 180] [--sections decode,parity,...]
`--tiny` runs every section a CPU can at the tiny profile's sizes (the test suite runs it); its output is noise.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SECTIONS = ("decode", "parity", "superres", "codec", "song_inprocess", "song_worker")
LIMITS_S = {"decode": 150, "parity": 60, "superres": 60, "codec": 45, "song_inprocess": 120, "song_worker": 240}
PROMPT = list(range(1, 65))


# --- shared set-up (inside each child) --------------------------------------------------------------


def _setup(args):
    import torch
    from app.pipeline.profiles import load_profile

    torch.manual_seed(0)
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, os.cpu_count() // 2))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    profile = load_profile("tiny" if args.tiny else "khala", "/nonexistent")  # sizes only: no file is read
    return torch, device, profile


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _random_gpt(torch, device, spec, *, causal: bool, seed: int):
    """A Megatron GPT of `spec` on `device` (bf16 on CUDA) with N(0, 0.02) weights drawn there (norms ~1)."""
    from app.pipeline.music import megatron_backend as mb

    model = mb.build_gpt(spec, causal=causal, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("layernorm.weight") else 0.0, 0.02, generator=generator)
    return model


def _backbone(torch, device, profile):
    from app.pipeline.music import megatron_backend as mb
    from app.pipeline.music.torch_engine import TorchCausalLM, from_megatron

    model = _random_gpt(torch, device, profile.backbone, causal=True, seed=0)
    return model, mb.MegatronCausalLM(model), TorchCausalLM(from_megatron(model, mb.model_spec(model)))


class Clock:
    """A StageControl that timestamps every progress report (device synchronised) and can stop the run after
    `stop_after` tokens: per-block step times without timing the whole song on slow variants."""

    def __init__(self, torch, device, stop_after: int | None = None):
        from app.pipeline.control import StageControl

        self.marks: list[tuple[float, int]] = []
        self.stop_after = stop_after

        def report(fraction: float, detail: str) -> None:
            _sync(torch, device)
            self.marks.append((time.perf_counter(), int(detail.split("/")[0])))

        self.control = StageControl(
            report=report,
            cancel_requested=lambda: bool(self.stop_after and self.marks and self.marks[-1][1] >= self.stop_after),
        )

    def ms_per_step(self, part: slice = slice(None)) -> float | None:
        """Median ms per token-step (all tracks together) between consecutive reports within `part`."""
        pairs = list(itertools.pairwise(self.marks))[part]
        rates = [(t1 - t0) * 1e3 / (n1 - n0) for (t0, n0), (t1, n1) in pairs if n1 > n0]
        return round(statistics.median(rates), 3) if rates else None

    def mean_ms_per_step(self) -> float | None:
        (t0, n0), (t1, n1) = self.marks[0], self.marks[-1]
        return round((t1 - t0) * 1e3 / (n1 - n0), 3) if n1 > n0 else None


def _generate(lm, profile, frames, seeds, control, loop="auto", prompt=PROMPT, limit=None):
    from app.pipeline.music.backbone import generate_coarse_tracks

    return generate_coarse_tracks(
        lm,
        prompt,
        profile=profile,
        num_frames=frames,
        temperature=1.0,
        top_k=profile.backbone_top_k,
        seeds=seeds,
        control=control,
        loop=loop,
    )


# --- sections ------------------------------------------------------------------------------------------


def section_decode(args) -> dict:
    """ms/step of each loop variant early in a song-sized cache (stopped after `window` frames) and late (a
    long prompt puts the decode at the song's last positions); the graphed device loop also runs the whole
    song, the figure the targets are about."""
    torch, device, profile = _setup(args)
    from app.pipeline.control import Canceled
    from app.pipeline.music.slots import SongPlan, decode_song

    _, megatron, plain = _backbone(torch, device, profile)
    frames = profile.frames_for(args.seconds)
    window = min(args.window, frames)
    late_prompt = [1 + i % 500 for i in range(2 * (frames - window))]
    result: dict = {"device": str(device), "song_frames": frames, "window_frames": window}

    def plan(limit: int) -> SongPlan:
        return SongPlan.fixed_length(profile, limit, top_k=profile.backbone_top_k)

    def device_loop(prompt, limit, clock, graphs):
        decode_song(
            plain,
            prompt,
            plan(limit),
            [1, 2],
            lambda frames: clock.control.step(2 * frames, 2 * limit, "tokens"),
            check_every=8,
            use_graphs=graphs,
        )

    def reference(lm, seeds):
        return lambda prompt, limit, clock, graphs: _generate(
            lm, profile, limit, seeds, clock.control, loop="reference", prompt=prompt
        )

    # (name, run, graphs, tracks, reports skipped as warm-up: the reference loops report every frame, the
    # device loops every block, whose first report already follows the warm-up and capture)
    variants = (
        ("megatron", reference(megatron, [1]), False, 1, 2),
        ("reference_loop", reference(plain, [1, 2]), False, 2, 2),
        ("device_loop", device_loop, False, 2, 0),
        ("device_loop_graphs", device_loop, True, 2, 0),
    )
    for name, run, graphs, tracks, warm_up in variants:
        if graphs and device.type != "cuda":
            result[name] = {"skipped": "CUDA graphs need a CUDA device"}
            continue
        row: dict = {"tracks_per_step": tracks}
        for phase, prompt, limit in (("early", PROMPT, frames), ("late", late_prompt, window)):
            clock = Clock(torch, device, stop_after=2 * window)
            try:
                run(prompt, limit, clock, graphs)
            except Canceled:
                pass
            row[f"ms_per_step_{phase}"] = clock.ms_per_step(slice(warm_up, None))
        result[name] = row
    if device.type == "cuda":  # the whole song on the fastest variant
        clock = Clock(torch, device)
        started = time.perf_counter()
        device_loop(PROMPT, frames, clock, True)
        result["device_loop_graphs"].update(
            ms_per_step_song=clock.mean_ms_per_step(), song_seconds=round(time.perf_counter() - started, 2)
        )
    baseline = result["megatron"]["ms_per_step_early"]
    for name in ("reference_loop", "device_loop", "device_loop_graphs"):
        row = result[name]
        if baseline and row.get("ms_per_step_early"):
            row["speedup_vs_megatron_early"] = round(baseline / row["ms_per_step_early"], 2)
    return result


def section_parity(args) -> dict:
    """Teacher-forced: the same tokens through today's full head and the device loop's window head."""
    torch, device, profile = _setup(args)
    from app.pipeline.control import StageControl
    from app.pipeline.music.slots import SongPlan, decode_song

    _, megatron, plain = _backbone(torch, device, profile)
    frames = min(args.window, profile.frames_for(args.seconds))
    codes = _generate(plain, profile, frames, [1, 2], StageControl(), loop="reference")
    starts = (profile.audio_token_offset(0), profile.audio_token_offset(1))
    fed = [[starts[q] + int(c[q, f]) for c in codes] for f in range(frames) for q in range(2)]
    size = profile.codebook_size

    def window_of(step: int) -> slice:
        start = starts[(step + 1) % 2]
        return slice(start, start + size)

    with torch.inference_mode():
        plain.reset(len(PROMPT) + len(fed), batch=2)
        plain.prefill_batch(PROMPT)
        full = [plain.decode_batch(tokens)[:, window_of(i)] for i, tokens in enumerate(fed)]
        plain.reset(len(PROMPT) + len(fed), batch=2)
        plain.prefill_batch(PROMPT)
        weight = plain.model.output.weight
        windowed = []
        for i, tokens in enumerate(fed):
            position = torch.tensor([len(PROMPT) + i], device=device)
            hidden = plain.cached_hidden(torch.tensor(tokens, device=device)[:, None], position)[:, 0]
            windowed.append((hidden @ weight[window_of(i)].t()).float())
        plain.release()
        full_t, win_t = torch.stack(full), torch.stack(windowed)
        megatron.reset(len(PROMPT) + len(fed))
        mega = [megatron.prefill(PROMPT)] + [megatron.decode(tokens[0]) for tokens in fed[:-1]]
        plain.reset(len(PROMPT) + len(fed))
        ours = [plain.prefill(PROMPT)] + [plain.decode(tokens[0]) for tokens in fed[:-1]]
        megatron.release()
        plain.release()
    mega_t, ours_t = torch.stack(mega), torch.stack(ours)
    result = {
        "steps": len(fed),
        "window_head_vs_full_head": {
            "max_abs_diff": float((full_t - win_t).abs().max()),
            "argmax_agree": float((full_t.argmax(-1) == win_t.argmax(-1)).float().mean()),
        },
        "torch_vs_megatron": {
            "max_abs_diff": float((mega_t - ours_t).abs().max()),
            "argmax_agree": float((mega_t.argmax(-1) == ours_t.argmax(-1)).float().mean()),
        },
    }
    plan = SongPlan(
        window_starts=starts,
        codebook_size=size,
        end_id=None,
        limit=frames,
        min_frames=frames,
        expected_frames=frames,
        top_k=profile.backbone_top_k,
        temperature=1.0,
    )
    # each track alone: a slot's codes are those the reference loop gives the track alone (a batch of the
    # engine's own kernels may differ in the last bits: bf16 on a GPU)
    alone = [_generate(plain, profile, frames, [seed], StageControl(), loop="reference")[0] for seed in (1, 2)]
    eager = decode_song(plain, PROMPT, plan, [1, 2], use_graphs=False)
    result["device_loop_codes_equal_reference_loop"] = len(eager) == len(alone) and all(
        torch.equal(a, b) for a, b in zip(eager, alone, strict=True)
    )
    if device.type == "cuda":
        graphed = decode_song(plain, PROMPT, plan, [1, 2], use_graphs=True)
        result["graphs_codes_equal_eager"] = len(eager) == len(graphed) and all(
            torch.equal(a, b) for a, b in zip(eager, graphed, strict=True)
        )
    return result


def _superres_lm(torch, device, profile):
    from app.pipeline.music import megatron_backend as mb
    from app.pipeline.music.torch_engine import TorchBidirectionalLM, from_megatron

    model = _random_gpt(torch, device, profile.superres, causal=False, seed=1)
    return TorchBidirectionalLM(from_megatron(model, mb.model_spec(model)))


def _random_coarse(torch, profile, frames, track):
    generator = torch.Generator().manual_seed(track)
    return torch.randint(0, profile.codebook_size, (2, frames), generator=generator)


def section_superres(args) -> dict:
    torch, device, profile = _setup(args)
    from app.pipeline.control import StageControl
    from app.pipeline.music.superres import fill_fine

    lm = _superres_lm(torch, device, profile)
    frames = profile.frames_for(args.seconds)
    _sync(torch, device)
    started = time.perf_counter()
    for track in (0, 1):
        fill_fine(
            lm,
            _random_coarse(torch, profile, frames, track),
            profile=profile,
            seed=track,
            control=StageControl(),
            prompt_ids=PROMPT,
        )
    _sync(torch, device)
    return {
        "frames": frames,
        "tracks": 2,
        "passes": profile.codec.num_codebooks - 2,
        "seconds": round(time.perf_counter() - started, 3),
    }


def section_codec(args) -> dict:
    torch, device, profile = _setup(args)
    from app.pipeline.music.codec import decode_codes, random_decoder
    from app.pipeline.control import StageControl

    decoder = random_decoder(profile.codec, seed=2).to(device)
    frames = profile.frames_for(args.seconds)
    codes = torch.randint(0, profile.codec.codebook_size, (profile.codec.num_codebooks, frames))
    decode_codes(decoder, codes[:, :64], StageControl())  # warm-up
    _sync(torch, device)
    started = time.perf_counter()
    for _ in range(2):
        audio = decode_codes(decoder, codes, StageControl())
    _sync(torch, device)
    return {
        "frames": frames,
        "tracks": 2,
        "samples": int(audio.shape[-1]),
        "seconds": round(time.perf_counter() - started, 3),
    }


def section_song_inprocess(args) -> dict:
    """The four stages, models resident: device-loop backbone for both tracks, then per track superres,
    codec and WAV + MP3 export."""
    torch, device, profile = _setup(args)
    from app.pipeline.music.codec import decode_codes, random_decoder
    from app.pipeline.control import StageControl
    from app.pipeline.music.superres import fill_fine

    _, _, plain = _backbone(torch, device, profile)
    superres_lm = _superres_lm(torch, device, profile)
    decoder = random_decoder(profile.codec, seed=2).to(device)
    frames = profile.frames_for(args.seconds)
    work = Path(tempfile.mkdtemp(prefix="encore-song-"))
    stages: dict[str, float] = {}

    def timed(name, run):
        _sync(torch, device)
        started = time.perf_counter()
        value = run()
        _sync(torch, device)
        stages[name] = round(stages.get(name, 0.0) + time.perf_counter() - started, 3)
        return value

    started = time.perf_counter()
    coarse = timed("backbone", lambda: _generate(plain, profile, frames, [1, 2], StageControl()))
    for track, codes in enumerate(coarse):
        fine = timed(
            "superres",
            functools.partial(
                fill_fine, superres_lm, codes, profile=profile, seed=track, control=StageControl(), prompt_ids=PROMPT
            ),
        )
        audio = timed("decode", functools.partial(decode_codes, decoder, fine, StageControl()))
        wav = work / f"track{track}.wav"
        timed(
            "export",
            functools.partial(_export_track, audio, wav, work / f"track{track}.mp3", profile.codec.sample_rate),
        )
    return {"frames": frames, "tracks": 2, "stages": stages, "seconds": round(time.perf_counter() - started, 2)}


def _export_track(audio, wav: Path, mp3: Path, sample_rate: int) -> None:
    from app.pipeline.music import export

    export.write_wav(audio, wav, sample_rate)
    export.write_mp3(wav, mp3)


def write_models(profile, directory: Path) -> Path:
    """Random-weight models in the profile's on-disk layout, by the tiny writer or, at Khala sizes, built
    and filled on the device and saved from there (bf16 on CUDA: half the bytes, no CPU-side init)."""
    if profile.name == "tiny":
        subprocess.run(
            [sys.executable, "-m", "app.pipeline.tiny", "--out", str(directory)],
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return directory
    import torch
    from app.pipeline.music import codec, megatron_backend as mb

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _write_wordlevel_tokenizer(profile.text_vocab_size, profile.tokenizer_dir)
    for spec, target, causal, seed in (
        (profile.backbone, profile.backbone_dir, True, 0),
        (profile.superres, profile.superres_dir, False, 1),
    ):
        model = _random_gpt(torch, device, spec, causal=causal, seed=seed)
        mb.save_checkpoint(model, target)
        del model
    (directory / "checkpoints").mkdir(parents=True, exist_ok=True)
    codec.write_tiny_codec(profile.codec, directory / "checkpoints" / "dac_rvq_1.ckpt", seed=2)
    return directory


def _write_wordlevel_tokenizer(size: int, directory: Path) -> None:
    """A tokenizer of exactly `size` tokens with the Llama-3 special tokens last, for Khala-sized vocabularies."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from app.pipeline.music.prompt import BOS, EOS, LLAMA3_SPECIAL_TOKEN_COUNT, llama3_special_tokens

    regular = size - LLAMA3_SPECIAL_TOKEN_COUNT
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(regular)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in llama3_special_tokens()])
    directory.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS).save_pretrained(str(directory))


def section_song_worker(args) -> dict:
    """Submission to both MP3s through a real prefork worker on queue gpu0 (models loaded before the clock)."""
    _setup(args)
    from bench.common import start_redis

    root = Path(tempfile.mkdtemp(prefix="encore-song-worker-"))
    redis_proc, redis_url = start_redis(root)
    from app.pipeline.profiles import load_profile

    profile = load_profile("tiny" if args.tiny else "khala", root / "models")
    write_started = time.perf_counter()
    write_models(profile, root / "models")
    written_s = time.perf_counter() - write_started
    env = {
        "REDIS_URL": redis_url,
        "ENCORE_MODEL_DIR": str(root / "models"),
        "ENCORE_MUSIC_PROFILE": profile.name,
        "ENCORE_ARTIFACT_DIR": str(root / "artifacts"),
        "ENCORE_LOG_DIR": str(root / "logs"),
        "ENCORE_HEARTBEAT_S": "0.5",
        "ENCORE_PYTHON": sys.executable,
        "ENCORE_PRELOAD": "1",
        "ENCORE_SONG_END": "duration",
        "ENCORE_WORKER_CACHE_DIR": str(root / "cache"),
    }
    os.environ.update(env)
    from app.adapters.celery_app import make_celery
    from app.core.config import load_settings
    from app.control.routing import route_job
    from app.control.services import build_services

    settings = load_settings()
    svc = build_services(settings)
    worker = subprocess.Popen(
        ["bash", str(REPO / "worker_entrypoint.sh"), "0"],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + LIMITS_S["song_worker"] - 30
        while not any(w.get("status") == "idle" for w in svc.workers.workers()):
            if time.monotonic() > deadline or worker.poll() is not None:
                log = root / "logs" / "worker_0.log"
                return {"error": "worker did not come up", "log": log.read_text()[-2000:] if log.exists() else ""}
            time.sleep(0.2)
        params = {
            "mode": "instrumental",
            "tags": "ambient",
            "prompt": "",
            "lyrics": "",
            "duration_s": float(args.seconds),
            "temperature": 1.0,
            "top_k": profile.backbone_top_k,
            "num_tracks": 2,
        }
        job_id = svc.jobs.create("music", params, [{"seed": 3}, {"seed": 4}], cost=float(args.seconds))
        started = time.monotonic()
        route_job(svc, make_celery(settings), job_id, 2)
        while True:
            tracks = svc.jobs.tracks(job_id, 2)
            if all(t["state"] in ("done", "failed", "canceled") for t in tracks) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return {
            "states": [t["state"] for t in tracks],
            "errors": [t["error"] for t in tracks],
            "seconds": round(time.monotonic() - started, 2),
            "models_written_s": round(written_s, 1),
            "stages": {t["track"]: {k: v.get("duration_s") for k, v in t["stages"].items()} for t in tracks},
        }
    finally:
        os.killpg(worker.pid, 9)
        redis_proc.terminate()


# --- driver ------------------------------------------------------------------------------------------


def _run_section(name: str, argv: list[str], limit: float) -> dict:
    from bench.common import run_section

    return run_section(__file__, name, argv, limit, REPO)


def _summary(results: dict) -> dict:
    decode = results.get("decode", {})
    variants = [
        decode.get("device_loop_graphs", {}).get("ms_per_step_song"),  # the song's average (CUDA)
        decode.get("device_loop", {}).get("ms_per_step_early"),
    ]
    return {
        "device": decode.get("device"),
        "decode_ms_per_step": next((v for v in variants if v), None),
        "megatron_ms_per_step": decode.get("megatron", {}).get("ms_per_step_early"),
        "superres_s": results.get("superres", {}).get("seconds"),
        "codec_s": results.get("codec", {}).get("seconds"),
        "song_s_inprocess": results.get("song_inprocess", {}).get("seconds"),
        "song_s_worker": results.get("song_worker", {}).get("seconds"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny profile sizes (CPU smoke run; output is noise)")
    parser.add_argument("--seconds", type=float, default=None, help="song length (default 180; tiny 3)")
    parser.add_argument("--window", type=int, default=None, help="frames timed on the slow loops (128; tiny 16)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--section", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seconds = args.seconds or (3.0 if args.tiny else 180.0)
    args.window = args.window or (24 if args.tiny else 128)
    if args.section:
        print(json.dumps(globals()[f"section_{args.section}"](args), default=str), flush=True)
        return
    argv = [*(["--tiny"] if args.tiny else []), "--seconds", str(args.seconds), "--window", str(args.window)]
    results = {}
    for name in filter(None, args.sections.split(",")):
        if name not in SECTIONS:
            raise SystemExit(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        results[name] = _run_section(name, argv, LIMITS_S[name])
        print(json.dumps({name: results[name]}, default=str), flush=True)
    print(json.dumps({"summary": _summary(results)}), flush=True)


if __name__ == "__main__":
    main()
