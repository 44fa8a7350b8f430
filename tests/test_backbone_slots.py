"""run_backbone_slots (app/pipeline/music/stages.py): tracks of different songs (other prompts, lengths, samplers,
seeds) through one SlotDecoder, joining as slots free, each saved with the codes run_backbone_tracks gives it
alone. This is the pipeline half of batching the backbone across jobs; the worker drives it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.pipeline.control import StageControl
from app.pipeline.music.stages import BackboneTrack, MusicModels, _load_codes, run_backbone_slots, run_backbone_tracks

torch.set_num_threads(2)

SONGS = [
    {
        "mode": "instrumental",
        "tags": "ambient",
        "prompt": "",
        "lyrics": "",
        "duration_s": 2.0,
        "temperature": 1.0,
        "top_k": 80,
    },
    {
        "mode": "vocal",
        "tags": "pop, female vocals",
        "prompt": "a slow song about the sea",
        "lyrics": "[verse]\nwaves come in\nwaves go out",
        "duration_s": 3.0,
        "temperature": 0.7,
        "top_k": 5,
    },
    {
        "mode": "instrumental",
        "tags": "rock",
        "prompt": "",
        "lyrics": "",
        "duration_s": 1.0,
        "temperature": 1.2,
        "top_k": 1,
    },
]


@pytest.fixture(scope="module")
def models(tiny_profile):
    return MusicModels(tiny_profile, "keep_loaded", device=torch.device("cpu"), engine="torch")


@pytest.mark.slow  # ~50 s: every track decoded twice, batched and alone
@pytest.mark.parametrize("song_end", ["duration", "model"])
def test_tracks_of_other_songs_batched_get_their_codes_alone(models, tiny_profile, tmp_path, song_end, monkeypatch):
    # The module's models, loaded once, with this case's song end: put back after it (monkeypatch).
    monkeypatch.setattr(models, "profile", dataclasses.replace(tiny_profile, song_end=song_end))
    tracks = [BackboneTrack(SONGS[i % len(SONGS)], seed=10 + i, out=tmp_path / f"batched{i}.pt") for i in range(5)]
    finished: list[int] = []
    songs = run_backbone_slots(models, tracks, slots=3, on_finished=lambda track, song: finished.append(track.seed))
    assert sorted(finished) == [10 + i for i in range(5)]  # each reported once, as it ended
    for index, track in enumerate(tracks):
        alone = tmp_path / f"alone{index}.pt"
        info = run_backbone_tracks(models, track.params, [track.seed], [alone], StageControl())
        assert torch.equal(_load_codes(track.out), _load_codes(alone)), f"track {index} ({song_end})"
        assert songs[index] == info["songs"][0]
