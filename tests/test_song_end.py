"""The backbone ends a song where the model ends it: end-of-text sampled beside each codebook window.

Random weights would end at random, so these tests use a tiny backbone whose weights make it end on cue
(harness/models.py, make_ending): a track ends on the frame after its first trigger code, at a frame its seed decides.
"""

from __future__ import annotations

import json
import shutil
import wave

import pytest
import torch

from app.pipeline.music.backbone import generate_coarse, generate_coarse_tracks
from app.pipeline.control import StageControl
from app.pipeline.music.stages import song_length
from app.control.services import build_services
from harness.models import TRIGGER, write_ending_backbone

torch.set_num_threads(2)
PROMPT = [1, 42, 7, 300]


def run(lm, profile, end_id, seed=0, **overrides):
    args = dict(
        profile=profile,
        num_frames=40,
        temperature=1.0,
        top_k=profile.backbone_top_k,
        seed=seed,
        control=StageControl(),
        end_id=end_id,
        max_frames=400,
        min_frames=1,
    )
    args.update(overrides)
    return generate_coarse(lm, PROMPT, **args)


def first_trigger(codes) -> int:
    hits = (codes[1] == TRIGGER).nonzero()
    return int(hits[0]) if len(hits) else -1


@pytest.mark.parametrize("engine", ["megatron", "torch"])
def test_song_ends_on_the_frame_after_the_trigger(ending, tiny_profile, end_id, engine):
    lengths = set()
    for seed in range(4):
        codes = run(ending[engine], tiny_profile, end_id, seed=seed)
        frames = codes.shape[1]
        assert 1 <= frames < 400, "the model must end the song before the cap"
        assert first_trigger(codes) == frames - 1  # ended right after its first trigger code, not before
        assert codes.min() >= 0 and codes.max() < tiny_profile.codebook_size
        lengths.add(frames)
    assert len(lengths) > 1, "the seed, not a count, decides where each song ends"


def test_both_engines_end_the_same_song_at_the_same_frame(ending, tiny_profile, end_id):
    for seed in (0, 1):
        assert torch.equal(
            run(ending["megatron"], tiny_profile, end_id, seed=seed),
            run(ending["torch"], tiny_profile, end_id, seed=seed),
        )


def test_batched_tracks_end_each_on_its_own(ending, tiny_profile, end_id):
    seeds = [0, 1, 2]
    alone = [run(ending["torch"], tiny_profile, end_id, seed=seed) for seed in seeds]
    assert len({codes.shape[1] for codes in alone}) > 1
    together = generate_coarse_tracks(
        ending["torch"],
        PROMPT,
        profile=tiny_profile,
        num_frames=40,
        temperature=1.0,
        top_k=tiny_profile.backbone_top_k,
        seeds=seeds,
        control=StageControl(),
        end_id=end_id,
        max_frames=400,
        min_frames=1,
    )
    assert [codes.shape for codes in together] == [codes.shape for codes in alone]
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))


def test_no_end_before_min_frames_and_a_cap_when_the_model_does_not_end(ending, tiny_profile, end_id):
    seed, early = next(
        (seed, codes)
        for seed in range(20)
        if 3 <= (codes := run(ending["torch"], tiny_profile, end_id, seed=seed)).shape[1] < 30
    )
    held = run(ending["torch"], tiny_profile, end_id, seed=seed, min_frames=30)
    assert held.shape[1] >= 30 > early.shape[1]  # a trigger before frame 30 could not end it...
    assert held[1, -1] == TRIGGER and not (held[1, 29:-1] == TRIGGER).any()  # ...the first one after it did
    capped = run(ending["torch"], tiny_profile, end_id, seed=seed, max_frames=early.shape[1] - 1)
    assert capped.shape[1] == early.shape[1] - 1 and torch.equal(capped, early[:, :-1])


def test_fixed_length_never_samples_end_of_text(ending, tiny_profile):
    """end_id=None (the tiny profile's song_end="duration"): exactly num_frames, however the model would end."""
    codes = run(ending["torch"], tiny_profile, None, num_frames=60)
    assert codes.shape == (2, 60) and (codes[1] == TRIGGER).any()


def test_open_ended_progress_stays_below_one_until_the_end(ending, tiny_profile, end_id):
    reports = []
    control = StageControl(report=lambda fraction, detail: reports.append((fraction, detail)))
    codes = run(ending["torch"], tiny_profile, end_id, seed=1, num_frames=4, control=control)
    assert all(fraction <= 0.99 for fraction, _ in reports[:-1])
    assert reports[-1] == (1.0, f"{2 * codes.shape[1]}/{2 * codes.shape[1]} tokens")
    assert any(detail.endswith("/8 tokens") for _, detail in reports[:-1])  # measured against the expected 4 frames


def test_song_length_caps(tiny_profile):
    import dataclasses

    khala_like = dataclasses.replace(tiny_profile, song_end="model")
    length = song_length(khala_like, 60.0, prompt_tokens=100, margin_s=30.0)
    assert length.model_ends and length.expected_frames == khala_like.frames_for(60.0)
    assert length.max_frames == khala_like.frames_for(90.0) and length.min_frames == khala_like.frames_for(1.0)
    longest = song_length(khala_like, khala_like.max_duration_s, prompt_tokens=100, margin_s=90.0)
    assert longest.max_frames == 23_552 // 2  # the reference's --num-tokens-to-generate
    crowded = song_length(khala_like, khala_like.max_duration_s, prompt_tokens=4096, margin_s=90.0)
    assert crowded.max_frames == (25_600 - 4096) // 2  # what the KV cache holds after the prompt
    fixed = song_length(tiny_profile, 60.0, prompt_tokens=100, margin_s=30.0)
    assert not fixed.model_ends and fixed.max_frames == fixed.expected_frames == tiny_profile.frames_for(60.0)
    assert tiny_profile.song_end == "duration" and tiny_profile.max_duration_s == 546.0


@pytest.mark.slow  # a job on a worker (~8 s here)
def test_a_whole_job_ends_where_the_model_ends_it(make_stack, tiny_models, tiny_profile, end_id, tmp_path):
    """Through a real worker with ENCORE_SONG_END=model: the record, the WAV and the metadata all report the
    song's actual length, shorter than requested."""
    models = tmp_path / "ending-models"
    shutil.copytree(tiny_models, models, ignore=shutil.ignore_patterns("backbone"))
    write_ending_backbone(
        tiny_profile, models / "backbone", end_id=end_id, trigger_id=tiny_profile.audio_token_offset(1) + TRIGGER
    )
    stack = make_stack(ENCORE_MODEL_DIR=str(models), ENCORE_SONG_END="model", ENCORE_SONG_MARGIN_S="5")
    stack.start_worker(0)
    requested = 20.0
    job_id = stack.submit_music(duration_s=requested, num_tracks=2, seed=3)
    record = stack.wait_job(job_id, timeout=180)
    artifacts = build_services(stack.settings).artifacts
    assert record["state"] == "done", record
    for track in record["tracks"]:
        song = track["song"]
        assert song["ended_by"] == "model" and 1.0 <= song["duration_s"] < requested
        assert song["duration_s"] == round(song["frames"] * 2048 / 44100, 3)
        wav = stack.client.get(f"/api/v1/jobs/{job_id}/tracks/{track['track']}.wav")
        assert wav.status_code == 200
        path = tmp_path / f"track{track['track']}.wav"
        path.write_bytes(wav.data)
        with wave.open(str(path)) as audio:
            assert audio.getnframes() == song["frames"] * 2048
        meta = artifacts.local_path(job_id, f"track{track['track']}.json")
        assert json.loads(meta.read_text())["song"] == song
    assert record["tracks"][0]["song"] != record["tracks"][1]["song"]  # each seed ends its own song
