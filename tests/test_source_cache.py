"""The per-source-video cache (issue 13, item 4): faces and VAE latents of a face video kept for the next
job on it. The cache alone (LRU by bytes, atomic entries, off at 0), the two lip-sync stages on real
media (second run on the same video: hit, identical output, nothing encoded; another video or other
settings: miss), and two jobs through a real worker whose records say miss, then hit."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from app.pipeline.control import StageControl
from app.pipeline.lipsync import stages
from app.pipeline.lipsync.source_cache import SourceCache, entry_key, file_digest
from harness.models import tiny_musetalk_profile
from harness.media import face_video, tone, upload


def test_entries_are_evicted_least_recently_used_first_within_the_byte_bound(tmp_path):
    cache = SourceCache(tmp_path / "c", max_bytes=3000)
    for name in ("a", "b", "c"):
        assert cache.write(name, bytes(1000))
        past = time.time() - {"a": 30, "b": 20, "c": 10}[name]
        os.utime(cache.root / name, (past, past))
    assert cache.read("a") == bytes(1000)  # a is now the most recently used
    assert cache.write("d", bytes(1000))  # 4000 > 3000: the least recently used (b) goes
    assert [cache.read(k) is not None for k in ("a", "b", "c", "d")] == [True, False, True, True]
    assert sum(size for _, size, _ in cache.entries()) <= 3000
    assert not cache.write("huge", bytes(3001)) and cache.read("huge") is None
    assert not list(cache.root.glob(".tmp-*"))  # no temporary file left behind


def test_a_cache_of_zero_bytes_is_off_and_keys_reject_paths(tmp_path):
    off = SourceCache(tmp_path / "off", max_bytes=0)
    assert not off.write("a", b"x") and off.read("a") is None
    with pytest.raises(ValueError):
        SourceCache(tmp_path / "c", max_bytes=10).read("../etc")
    assert entry_key("faces", video="1", margin=10) != entry_key("faces", video="1", margin=11)
    assert entry_key("faces", video="1", margin=10) == entry_key("faces", margin=10, video="1")


def test_latents_round_trip_by_source_frame(tmp_path):
    cache = SourceCache(tmp_path, max_bytes=1 << 20)
    latents = {3: torch.randn(8, 4, 4), 0: torch.randn(8, 4, 4)}
    assert cache.write_latents("k", latents)
    back = cache.read_latents("k")
    assert sorted(back) == [0, 3] and all(torch.equal(back[i], latents[i]) for i in latents)
    assert cache.read_latents("missing") == {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return stages.LipsyncModels(tiny_musetalk_profile(tmp_path_factory), "keep_loaded", device="cpu")


def _prepare(video, audio, scratch, cache):
    scratch.mkdir(parents=True)
    return stages.run_prepare(video, audio, 25.0, scratch, StageControl(), 120, cache=cache, face_threads=2)


def _lipsync(models, scratch, cache, **params):
    info = stages.run_lipsync_stage(
        models, {"fps": 25.0, "extra_margin": 10, "batch_size": 4, **params}, scratch, StageControl(), cache=cache
    )
    return info, (scratch / stages.PICTURE).read_bytes()


@pytest.mark.slow  # two jobs on a worker (~18 s here)
def test_the_second_job_on_a_video_hits_and_gives_the_same_picture(models, tmp_path):
    cache = SourceCache(tmp_path / "cache", max_bytes=64 << 20)
    video = face_video(tmp_path / "face.mp4", 1.0)
    audio = tone(tmp_path / "voice.wav", 1.6)  # longer than the video: the output cycles over it
    first = _prepare(video, audio, tmp_path / "one", cache)
    second = _prepare(video, audio, tmp_path / "two", cache)
    assert (first["cache"], second["cache"]) == ("miss", "hit")
    assert (tmp_path / "one" / stages.FACES).read_text() == (tmp_path / "two" / stages.FACES).read_text()
    info_one, picture_one = _lipsync(models, tmp_path / "one", cache)
    info_two, picture_two = _lipsync(models, tmp_path / "two", cache)
    assert (info_one["cache"], info_two["cache"]) == ("miss", "hit")
    assert info_one["latents_encoded"] == info_one["source_frames"] == 25 and info_two["latents_encoded"] == 0
    assert picture_one == picture_two  # the same frames, bit for bit through the same encoder

    other = face_video(tmp_path / "other.mp4", 1.0, size=240)  # another video: its own entries
    assert file_digest(other) != file_digest(video)
    assert _prepare(other, audio, tmp_path / "three", cache)["cache"] == "miss"
    assert _lipsync(models, tmp_path / "three", cache)[0]["cache"] == "miss"
    # the same video with another crop margin: faces hit, latents miss (they depend on the crop)
    assert _prepare(video, audio, tmp_path / "four", cache)["cache"] == "hit"
    assert _lipsync(models, tmp_path / "four", cache, extra_margin=20)[0]["cache"] == "miss"
    assert _prepare(video, audio, tmp_path / "five", None)["cache"] == "off"


@pytest.fixture
def stack(make_stack):
    stack = make_stack(ENCORE_LIPSYNC_CACHE_MB="64")
    stack.start_worker(0)
    return stack


@pytest.mark.slow  # jobs on a worker (~21 s here)
def test_jobs_through_a_worker_say_miss_then_hit(stack, tmp_path):
    """Three jobs on one 3 s face video: 1.0 s of audio (25 of its frames used), 1.2 s (30: 5 more to
    encode) and 0.8 s (all kept)."""
    video = face_video(tmp_path / "face.mp4", 3.0)
    states = []
    for seconds in (1.0, 1.2, 0.8):
        reply = upload(stack.client, video, tone(tmp_path / f"a{seconds}.wav", seconds), fps=25)
        assert reply.status_code == 202, reply.get_json()
        record = stack.wait_job(reply.get_json()["job_id"], timeout=180)
        assert record["state"] == "done", record
        info = record["tracks"][0]["stages"]
        states.append((info["prepare"]["info"]["cache"], info["lipsync"]["info"]["cache"]))
        assert info["lipsync"]["info"]["batch_size"] == 4  # the tiny profile's CPU default
    assert states == [("miss", "miss"), ("hit", "partial"), ("hit", "hit")]
    entries = list((stack.settings.worker_cache_dir / "lipsync-sources").iterdir())
    assert {path.name.split("-")[0] for path in entries} == {"faces", "latents"}
    assert json.loads(next(p for p in entries if p.name.startswith("faces")).read_text())["method"] == "landmarks"
