"""The music pipeline's four stages as plain functions over files: backbone → superres → decode → export.

Each function reads its inputs from paths, writes its outputs to paths, reports through StageControl and
gets its models from a `MusicModels` cache, so it runs the same under Celery, in a test or in a notebook.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from app.pipeline.music import backbone, codec, export, megatron_backend, prompt, superres, torch_engine
from app.pipeline.control import StageControl
from app.pipeline.media.ffmpeg import ON_PATH, MediaTools
from app.pipeline.music.engine import BatchedCausalLM
from app.pipeline.music.positions import frames_room
from app.pipeline.music.slots import SlotDecoder, SlotUpdate, SongPlan, TrackRequest, decode_queue
from app.pipeline.profiles import MusicProfile, TransformerSpec
from app.pipeline.runtime import ModelCache

# Models freed after each stage in one_shot mode (tokenizer and backbone stay, like the reference backend).
ONE_SHOT_RESIDENT = frozenset({"tokenizer", "backbone"})
FREED_AFTER = {"superres": ["superres"], "decode": ["codec"]}
# What a stage's detail calls each model while it loads it (the Khala layer shows its "Loading ..." phase then).
MODEL_LABELS = {"tokenizer": "tokenizer", "backbone": "backbone", "superres": "super-resolution", "codec": "decoder"}
LOADING = "loading "  # the prefix of a detail that says a model is being loaded, and of no other detail


def loading_detail(label: str) -> str:
    """The detail a stage reports while it loads a model, and only then: a client shows "loading" from it, so
    a stage whose models were already resident (ENCORE_PRELOAD, keep_loaded) never says it."""
    return f"{LOADING}{label} model"


def announced(load: Callable[[], Any], label: str, control: StageControl | None) -> Callable[[], Any]:
    """`load`, reporting `loading_detail(label)` through `control` first. A ModelCache calls it only when the
    model is absent, so the report is made exactly when a load happens (the stage's `loaded` list says so too)."""

    def load_announced() -> Any:
        if control is not None:
            control.report(0.0, loading_detail(label))
        return load()

    return load_announced


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_engine(engine: str, spec: TransformerSpec, directory: Path, *, causal: bool, device: torch.device):
    """Megatron-core loads the checkpoint either way; `torch` then runs its weights in plain PyTorch
    (torch_engine.py, the fast path), `megatron` runs Megatron's own forward (the reference)."""
    if engine not in ("torch", "megatron"):
        raise ValueError(f"unknown engine {engine!r} (torch or megatron)")
    model = megatron_backend.load_gpt(spec, directory, causal=causal, device=device)
    if engine == "megatron":
        return megatron_backend.MegatronCausalLM(model) if causal else megatron_backend.MegatronBidirectionalLM(model)
    plain = torch_engine.from_megatron(model, megatron_backend.model_spec(model))
    del model  # only the converted weights stay
    return torch_engine.TorchCausalLM(plain) if causal else torch_engine.TorchBidirectionalLM(plain)


class MusicModels:
    """Lazily loaded models of one profile, held in a ModelCache under the worker's runtime mode."""

    def __init__(
        self,
        profile: MusicProfile,
        mode: str,
        device: torch.device | None = None,
        engine: str = "torch",
        song_margin_s: float = 90.0,
    ):
        self.profile = profile
        self.song_margin_s = song_margin_s
        self.device = device or pick_device()
        self.engine = engine
        self.cache = ModelCache(mode, ONE_SHOT_RESIDENT)

    def tokenizer(self, loaded: list[str] | None = None, control: StageControl | None = None):
        return self._get("tokenizer", lambda: prompt.load_tokenizer(self.profile.tokenizer_dir), loaded, control)

    def backbone(self, loaded: list[str] | None = None, control: StageControl | None = None):
        return self._get(
            "backbone",
            lambda: load_engine(
                self.engine, self.profile.backbone, self.profile.backbone_dir, causal=True, device=self.device
            ),
            loaded,
            control,
        )

    def superres(self, loaded: list[str] | None = None, control: StageControl | None = None):
        return self._get(
            "superres",
            lambda: load_engine(
                self.engine, self.profile.superres, self.profile.superres_dir, causal=False, device=self.device
            ),
            loaded,
            control,
        )

    def codec(self, loaded: list[str] | None = None, control: StageControl | None = None):
        return self._get(
            "codec",
            lambda: codec.load_codec(self.profile.codec, self.profile.codec_path, device=self.device),
            loaded,
            control,
        )

    def _get(self, name: str, load: Callable[[], Any], loaded: list[str] | None, control: StageControl | None):
        """The model `name` from the cache; a load (only when it is absent) is announced through `control`."""
        return self.cache.get(name, announced(load, MODEL_LABELS[name], control), loaded)

    def backbone_batches(self, loaded: list[str] | None = None, control: StageControl | None = None) -> bool:
        """Whether the backbone engine generates several tracks in one batch."""
        return isinstance(self.backbone(loaded, control), BatchedCausalLM)

    def after_stage(self, stage: str) -> None:
        self.cache.after_stage(FREED_AFTER.get(stage, []))


def _save_codes(codes: torch.Tensor, path: Path) -> None:
    torch.save(codes.to(torch.int16 if codes.max() < 2**15 else torch.int32).cpu(), path)


def _load_codes(path: Path) -> torch.Tensor:
    return torch.load(path, weights_only=True).long()


def run_backbone(
    models: MusicModels,
    params: dict[str, Any],
    seed: int,
    out: Path,
    control: StageControl,
    loaded: list[str] | None = None,
) -> dict[str, Any]:
    """Prompt → coarse codes [2, frames] (q0, q1), saved to `out`."""
    return run_backbone_tracks(models, params, [seed], [out], control, loaded)


def _song_setup(
    models: MusicModels, params: dict[str, Any], loaded: list[str] | None, control: StageControl | None = None
) -> tuple[list[int], SongLength, int | None]:
    """A song's prompt ids, its length (song_length) and its end id (None: a fixed length), from its params."""
    tokenizer = models.tokenizer(loaded, control)
    prompt_ids = _prompt_ids(tokenizer, models.profile, params)
    length = song_length(models.profile, params["duration_s"], len(prompt_ids), models.song_margin_s)
    end_id = prompt.prompt_token_ids(tokenizer).eos if length.model_ends else None
    return prompt_ids, length, end_id


def run_backbone_tracks(
    models: MusicModels,
    params: dict[str, Any],
    seeds: list[int],
    outs: list[Path],
    control: StageControl,
    loaded: list[str] | None = None,
) -> dict[str, Any]:
    """Coarse codes of several tracks of one song (one seed and one output path each), generated in one
    batch when the engine batches (`backbone_batches`). `songs` in the result says, per track, how long it
    came out and what ended it ("model": end-of-text; "length": the cap; "duration": a fixed length)."""
    profile = models.profile
    lm = models.backbone(loaded, control)
    prompt_ids, length, end_id = _song_setup(models, params, loaded, control)
    started = time.monotonic()
    tracks = backbone.generate_coarse_tracks(
        lm,
        prompt_ids,
        profile=profile,
        num_frames=length.expected_frames,
        temperature=params["temperature"],
        top_k=params["top_k"],
        seeds=seeds,
        control=with_token_rate(control),
        end_id=end_id,
        max_frames=length.max_frames,
        min_frames=length.min_frames,
    )
    for coarse, out in zip(tracks, outs, strict=True):
        _save_codes(coarse, out)
    seconds = time.monotonic() - started
    tokens = sum(2 * int(coarse.shape[1]) for coarse in tracks)
    songs = [length.describe(int(coarse.shape[1]), profile) for coarse in tracks]
    return {
        "prompt_tokens": len(prompt_ids),
        "frames": songs[0]["frames"],
        "tracks_together": len(seeds),
        "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
        "songs": songs,
    }


TOKENS_DETAIL = re.compile(r"^(\d+)/(\d+) tokens$")
RATE_AFTER_S = 2.0  # a rate measured over less than this (a first block, a warm-up step) says nothing


class TokenRate:
    """Appends this run's generation rate to the backbone's "done/expected tokens" details, once it means
    something: measured from this run's first token report (not from a stage start that a restart, a model load
    or a batch adoption put earlier), over at least `after_s`, and at least 1 tok/s. Before that the detail has
    no rate, rather than a figure from too little data."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, after_s: float = RATE_AFTER_S):
        self.clock, self.after_s = clock, after_s
        self.first: tuple[float, int] | None = None  # (time, tokens) of this run's first token report

    def detail(self, detail: str) -> str:
        match = TOKENS_DETAIL.match(detail)
        if match is None:
            return detail
        now, done = self.clock(), int(match.group(1))
        if self.first is None:
            self.first = (now, done)
            return detail
        elapsed, tokens = now - self.first[0], done - self.first[1]
        rate = round(tokens / elapsed) if elapsed >= self.after_s else 0
        return f"{detail} · {rate} tok/s" if rate >= 1 else detail


def with_token_rate(control: StageControl, rate: TokenRate | None = None) -> StageControl:
    """`control` whose token details carry the run's rate (TokenRate)."""
    measure = rate or TokenRate()
    return StageControl(
        report=lambda fraction, detail: control.report(fraction, measure.detail(detail)),
        cancel_requested=control.cancel_requested,
    )


@dataclass(frozen=True)
class BackboneTrack:
    """One track for an in-flight batch: its job's parameters, its seed, where its coarse codes go."""

    params: dict[str, Any]
    seed: int
    out: Path


def backbone_request(
    models: MusicModels, track: BackboneTrack, loaded: list[str] | None = None, tag: object = None
) -> tuple[TrackRequest, SongLength]:
    """The SlotDecoder request that decodes `track` as run_backbone_tracks decodes it alone (its prompt, and the
    plan generate_coarse_tracks builds: windows, end id, frame limit and floor, sampler), with the
    song length it was planned from."""
    prompt_ids, length, end_id = _song_setup(models, track.params, loaded)
    plan = SongPlan.for_song(
        models.profile,
        num_frames=length.expected_frames,
        end_id=end_id,
        max_frames=length.max_frames,
        min_frames=length.min_frames,
        top_k=track.params["top_k"],
        temperature=track.params["temperature"],
    )
    return TrackRequest(tuple(prompt_ids), plan, track.seed, tag=tag), length


def run_backbone_slots(
    models: MusicModels,
    tracks: list[BackboneTrack],
    slots: int,
    on_finished: Callable[[BackboneTrack, dict[str, Any]], None] | None = None,
    loaded: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Coarse codes of tracks of any songs through one SlotDecoder of `slots` slots (app/pipeline/music/slots.py),
    each joining when a slot frees: each track's codes are those run_backbone_tracks gives it alone. Saves each
    to its `out` as it finishes and calls `on_finished(track, song)` then (the worker frees it at once);
    returns each track's song description, in order."""
    lm = models.backbone(loaded)
    planned = [backbone_request(models, track, loaded, tag=index) for index, track in enumerate(tracks)]
    requests = [request for request, _ in planned]
    max_len = max(request.positions for request in requests)
    songs: dict[int, dict[str, Any]] = {}

    def finished(update: SlotUpdate) -> None:
        if not update.finished or update.codes is None:
            return
        index = update.request.tag
        assert isinstance(index, int)
        _save_codes(update.codes, tracks[index].out)
        songs[index] = planned[index][1].describe(int(update.codes.shape[1]), models.profile)
        if on_finished is not None:
            on_finished(tracks[index], songs[index])

    decoder = SlotDecoder(lm, min(slots, len(requests)), max_len)
    try:
        decode_queue(decoder, requests, on_update=finished)
    finally:
        decoder.close()
    return [songs[index] for index in range(len(tracks))]


@dataclass(frozen=True)
class SongLength:
    """How long the backbone may write: the expected frames (the requested duration), the cap, the floor."""

    expected_frames: int
    max_frames: int
    min_frames: int
    model_ends: bool

    def describe(self, frames: int, profile: MusicProfile) -> dict[str, Any]:
        ended_by = "duration" if not self.model_ends else ("model" if frames < self.max_frames else "length")
        return {"frames": frames, "duration_s": round(frames / profile.frames_per_second, 3), "ended_by": ended_by}


def song_length(profile: MusicProfile, duration_s: float, prompt_tokens: int, margin_s: float) -> SongLength:
    """The profile's `song_end` decides: "duration" writes exactly the requested frames; "model" lets the
    model end the song (not in its first second), capped at the requested duration plus `margin_s`, at the
    reference's generated-token cap and at what the backbone's positions hold after the prompt."""
    expected = profile.frames_for(duration_s)
    if profile.song_end == "duration":
        return SongLength(expected, expected, expected, model_ends=False)
    cap = min(profile.frames_for(duration_s + margin_s), frames_room(profile, prompt_tokens))
    if cap < 1:
        raise ValueError(
            f"a {prompt_tokens}-token prompt leaves no room for audio in the backbone's "
            f"{profile.backbone.max_sequence_length} positions"
        )
    return SongLength(min(expected, cap), cap, min(profile.frames_for(1.0), cap), model_ends=True)


def _prompt_fields(params: dict[str, Any]) -> dict[str, Any]:
    return {
        "mode": params["mode"],
        "tags": params.get("tags") or None,
        "description": params.get("prompt") or None,
        "lyrics": params.get("lyrics") or None,
        "duration_s": params["duration_s"],
    }


def _prompt_ids(tokenizer, profile: MusicProfile, params: dict[str, Any]) -> list[int]:
    return prompt.build_prompt(tokenizer, profile, **_prompt_fields(params))


def run_superres(
    models: MusicModels,
    params: dict[str, Any],
    seed: int,
    coarse_path: Path,
    out: Path,
    control: StageControl,
    loaded: list[str] | None = None,
) -> dict[str, Any]:
    """Coarse codes → all 64 codebooks [64, frames], saved to `out`."""
    profile = models.profile
    prompt_ids = prompt.build_superres_prompt(models.tokenizer(loaded, control), profile, **_prompt_fields(params))
    lm = models.superres(loaded, control)
    fine = superres.fill_fine(
        lm,
        _load_codes(coarse_path),
        profile=profile,
        top_k=profile.superres_top_k,
        seed=seed,
        control=control,
        prompt_ids=prompt_ids,
    )
    _save_codes(fine, out)
    return {"codebooks": int(fine.shape[0])}


def run_decode(
    models: MusicModels, fine_path: Path, wav_out: Path, control: StageControl, loaded: list[str] | None = None
) -> dict[str, Any]:
    """All codebooks → 44.1 kHz stereo 16-bit WAV at `wav_out`."""
    decoder = models.codec(loaded, control)
    audio = codec.decode_codes(decoder, _load_codes(fine_path), control)
    export.write_wav(audio, wav_out, models.profile.codec.sample_rate)
    return {"samples": int(audio.shape[-1]), "seconds": audio.shape[-1] / models.profile.codec.sample_rate}


def run_export(
    wav_path: Path,
    mp3_out: Path,
    meta_out: Path,
    metadata: dict[str, Any],
    control: StageControl,
    *,
    tools: MediaTools = ON_PATH,
    ffmpeg_timeout_s: float = export.MP3_TIMEOUT_S,
) -> None:
    """WAV → 320 kb/s MP3 (with `tools`' ffmpeg, stopped past `ffmpeg_timeout_s`) plus a JSON metadata file."""
    control.step(0, 2, "files")
    export.write_mp3(wav_path, mp3_out, bitrate="320k", tools=tools, timeout_s=ffmpeg_timeout_s)
    control.step(1, 2, "files")
    export.write_metadata(meta_out, metadata)
    control.step(2, 2, "files")


def metadata_json(
    params: dict[str, Any], seed: int, profile: MusicProfile, song: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The track's JSON file: the request, the seed, the profile, and the song as it came out (`song`:
    frames, duration_s, ended_by)."""
    return json.loads(
        json.dumps(
            {
                **params,
                "seed": seed,
                "profile": profile.name,
                "sample_rate": profile.codec.sample_rate,
                "channels": 2,
                **({"song": song} if song else {}),
            }
        )
    )
