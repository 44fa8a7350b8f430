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


def test_the_runner_pauses_resumes_and_drops_tracks_by_key(models, tmp_path):
    """InFlightBackbone: a paused track leaves the slots (its slot is free, no block serves it) but stays the
    runner's; resumed, it ends with the codes it gets alone; a paused track can be dropped (a cancel)."""
    from app.pipeline.music.inflight import InFlightBackbone

    runner = InFlightBackbone(models, slots=2)
    assert not runner.decoder.use_graphs and not runner.decoder.whole_frame
    # on a CPU, CUDA graphs asked for are not used (the batched mode's frame, cut to the tracks, runs eagerly)
    graphs_asked = InFlightBackbone(models, slots=2, batched_matmul=True, cuda_graphs=True)
    assert not graphs_asked.decoder.use_graphs and not graphs_asked.decoder.whole_frame
    graphs_asked.close()
    tracks = {key: BackboneTrack(SONGS[0], seed=20 + key, out=tmp_path / f"t{key}.pt") for key in range(3)}
    runner.admit(0, tracks[0])
    runner.admit(1, tracks[1])
    runner.step()
    runner.pause(0)
    assert runner.keys == [1] and runner.paused == [0] and runner.free == 1 and 0 in runner
    runner.admit(2, tracks[2])
    block = runner.step()
    assert set(block.progress) | {f.key for f in block.finished} == {1, 2}  # the paused track was not stepped
    runner.pause(2)
    runner.drop(2)
    assert 2 not in runner and runner.paused == [0] and runner.free >= 1  # track 1 may have ended too
    runner.resume(0)
    assert 0 in runner.keys and runner.paused == []
    while runner.keys:
        runner.step()
    runner.close()
    for key in (0, 1):
        alone = tmp_path / f"alone{key}.pt"
        run_backbone_tracks(models, tracks[key].params, [tracks[key].seed], [alone], StageControl())
        assert torch.equal(_load_codes(tracks[key].out), _load_codes(alone)), key
