"""Progress as clients see it only moves forward (issue 24, item 4): the Khala percentage is one figure over a
track's whole chain (no drop from 99 to 1 between decode and export), a stage says "loading" only when it loads a
model, a backbone rate is shown only once it is measured over enough of its own run, and the CLI's lines neither
replay "waiting for the worker (0%)" at each stage nor say a state twice. The pure rules first, then a real worker:
the Khala reply polled to a job's end, and every event of a job, against what its stages recorded they loaded."""

from __future__ import annotations

import io
import json
import re

import pytest
import requests

from app.clients.cli import submitted_line
from app.clients.http_client import sse_messages
from app.clients.reporters import LineReporter, describe, ended_reason, track_fraction
from app.core.kinds import MUSIC
from app.http import khala
from app.pipeline.control import StageControl
from app.pipeline.music import stages as music_stages
from app.pipeline.runtime import ModelCache
from harness.processes import wait_until

KHALA_SONG = {"mode": "instrumental", "prompt_mode": "tags", "tags": "synthpop", "duration": 1, "top_k_bb": 50}


def _track(state: str, stage: str, status: str, progress: float, detail: str, finished: list[str]) -> dict:
    return {
        "track": 0,
        "state": state,
        "stage": stage,
        "status": status,
        "progress": progress,
        "detail": detail,
        "error": "",
        "worker": "gpu0@a",
        "worker_status": "busy",
        "queue": "gpu0",
        "queue_position": 0,
        "stages": {name: {"started_at": 1.0, "finished_at": 2.0} for name in finished},
    }


def music_chain() -> list[dict]:
    """A music track's records from submission to done, as the lifecycle writes them: each stage starts
    ("starting"), reports its progress up to 1.0, finishes (the next stage waits at 0 for the worker), and so on."""
    chain = [_track("queued", "", "queued", 0.0, "waiting for a worker", [])]
    finished: list[str] = []
    for stage in MUSIC.stages:
        chain.append(_track(stage.state, stage.name, f"running:{stage.name}", 0.0, "starting", finished))
        for done in (1, 30, 99, 100):
            detail = f"{done}/100 {stage.unit}"
            chain.append(_track(stage.state, stage.name, f"running:{stage.name}", done / 100, detail, finished))
        finished = [*finished, stage.name]
        following = MUSIC.next_stage(stage.name)
        if following is not None:
            waiting = f"waiting:{following.name}"
            chain.append(_track(following.state, following.name, waiting, 0.0, "waiting for the worker", finished))
    chain.append(_track("done", "export", "done", 1.0, "done", finished))
    return chain


def _record(track: dict) -> dict:
    return {
        "job_id": "a" * 32,
        "kind": "music",
        "state": "running",
        "params": {"lyrics": ""},
        "created_at": 0.0,
        "queue_position": 0,
        "tracks": [track],
    }


def non_decreasing(values: list[int] | list[float]) -> bool:
    return all(a <= b for a, b in zip(values, values[1:], strict=False))


# -- the Khala percentage and phase -----------------------------------------------------------------------------
def test_the_khala_percentage_is_one_figure_over_the_whole_chain():
    replies = [khala.job_reply(_record(track))["tracks"][0] for track in music_chain()]
    percents = [reply["progress"] for reply in replies]
    assert non_decreasing(percents), percents  # it used to fall from 99 to 1 at every stage change
    assert percents[0] == 0 and percents[-1] == 100 and percents[-2] == 99
    at_export = [r["progress"] for r, t in zip(replies, music_chain(), strict=True) if t["stage"] == "export"]
    assert min(at_export) >= 95, at_export  # export is the last sliver, not a new 1..99 under "Decoding audio..."


def test_the_overall_fraction_adds_finished_shares_and_the_running_share():
    shares = [0.75, 0.17, 0.05, 0.03]
    assert khala.overall_fraction(shares, 0, 0.5) == pytest.approx(0.375)
    assert khala.overall_fraction(shares, 1, 0.0) == pytest.approx(0.75) == khala.overall_fraction(shares, 0, 1.0)
    assert khala.overall_fraction(shares, 3, 1.0) == pytest.approx(1.0)
    assert khala.overall_fraction(shares, 2, 7.0) == khala.overall_fraction(shares, 2, 1.0)  # progress clamped
    assert sum(khala.STAGE_SHARES.values()) == pytest.approx(1.0)
    assert list(khala.STAGE_SHARES) == [stage.name for stage in MUSIC.stages]


def test_a_track_waiting_to_resume_keeps_the_stages_it_finished():
    restarted = _track("queued", "", "queued", 0.0, "waiting for a worker", ["backbone"])  # its superres died
    assert khala.job_reply(_record(restarted))["tracks"][0]["progress"] == 75
    assert track_fraction(restarted, "music") == 0.25


def test_loading_is_shown_only_while_a_stage_loads_a_model():
    starting = _track("superres", "superres", "running:superres", 0.0, "starting", ["backbone"])
    reply = khala.job_reply(_record(starting))["tracks"][0]
    assert reply["worker_phase"] == "superres" and not reply["phase_display"].startswith("Loading"), reply
    expected = {
        ("backbone", "backbone"): ("loading_backbone", "Loading backbone model..."),
        ("superres", "super-resolution"): ("loading_superres", "Loading super-resolution model..."),
        ("decode", "decoder"): ("loading_decoder", "Loading decoder model..."),
    }
    for (stage_name, label), phase in expected.items():
        stage = MUSIC.stage(stage_name)
        loading = _track(stage.state, stage.name, f"running:{stage.name}", 0.0, music_stages.loading_detail(label), [])
        reply = khala.job_reply(_record(loading))["tracks"][0]
        assert (reply["worker_phase"], reply["phase_display"]) == phase
    assert set(music_stages.MODEL_LABELS.values()) >= {"backbone", "super-resolution", "decoder"}


def test_a_model_load_is_announced_once_when_it_happens_and_never_when_resident():
    reports: list[tuple[float, str]] = []
    control = StageControl(report=lambda fraction, detail: reports.append((fraction, detail)))
    cache, loaded = ModelCache("keep_loaded", frozenset()), []
    for _ in range(2):
        model = cache.get("codec", music_stages.announced(lambda: object(), "decoder", control), loaded)
    assert reports == [(0.0, "loading decoder model")] and loaded == ["codec"] and model is not None
    assert music_stages.loading_detail("decoder").startswith(khala.LOADING)


# -- the backbone's rate ------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_rate_is_shown_only_once_measured_over_enough_of_the_run():
    clock = Clock()
    rate = music_stages.TokenRate(clock=clock, after_s=2.0)
    assert rate.detail("400/1000 tokens") == "400/1000 tokens"  # its first report: nothing to measure yet
    clock.now += 1.0
    assert rate.detail("500/1000 tokens") == "500/1000 tokens"  # 1 s: too little data
    clock.now += 1.5
    assert rate.detail("650/1000 tokens") == "650/1000 tokens · 100 tok/s"  # 250 tokens in 2.5 s of this run
    assert rate.detail("track 1: 5/10 tokens") == "track 1: 5/10 tokens"  # not a token count: left alone
    slow = music_stages.TokenRate(clock=clock, after_s=2.0)
    slow.detail("2/100 tokens")
    clock.now += 10.0
    assert slow.detail("4/100 tokens") == "4/100 tokens"  # under 1 tok/s says nothing, never "1 tok/s"


def test_the_khala_phase_shows_the_measured_rate_or_none():
    def display(detail: str) -> str:
        return khala.job_reply(_record(_track("backbone", "backbone", "running:backbone", 0.4, detail, [])))["tracks"][
            0
        ]["phase_display"]

    # a batched or restarted track has no start of its own run in its record: no rate from it (was "1 tok/s")
    assert display("40/100 tokens") == "Backbone generating · 30%"
    assert display("40/100 tokens · 85 tok/s") == "Backbone generating · 30% · 85 tok/s · 40 tokens"


# -- the CLI's lines ----------------------------------------------------------------------------------------------
def test_cli_lines_move_forward_and_skip_the_wait_between_stages():
    out = io.StringIO()
    reporter = LineReporter(out)
    for track in music_chain():
        reporter.update(_record(track))
    lines = out.getvalue().splitlines()
    assert not any("waiting for the worker" in line for line in lines), lines
    percents = [int(m.group(1)) for m in (re.search(r"\((\d+)%\)$", line) for line in lines) if m]
    assert non_decreasing(percents) and percents[0] == 0, lines
    assert [line.split()[2] for line in lines] == ["queued", "backbone", "superres", "decoding", "exporting", "done"]
    fractions = [track_fraction(track, "music") for track in music_chain()]
    assert non_decreasing(fractions) and fractions[-1] == 1.0  # what the bars show


def test_cli_lines_say_loading_only_for_a_load():
    out = io.StringIO()
    reporter = LineReporter(out)
    for detail in ("starting", "loading backbone model", "3/100 tokens", "9/100 tokens"):
        reporter.update(_record(_track("backbone", "backbone", "running:backbone", 0.0, detail, [])))
    assert [line.split("] ")[1] for line in out.getvalue().splitlines()] == [
        "starting (0%)",
        "loading backbone model (0%)",
        "3/100 tokens (0%)",
    ]


def test_an_ended_track_says_its_state_once():
    canceled = {**_track("canceled", "backbone", "canceled", 0.3, "canceled during backbone", []), "error": ""}
    assert ended_reason(canceled) == "canceled during backbone"
    assert describe(canceled, "music") == "track 0 canceled during backbone"
    failed = {**canceled, "state": "failed", "error": "backbone failed: out of memory"}
    assert describe(failed, "music") == "track 0 failed: backbone failed: out of memory"
    assert ended_reason({**canceled, "detail": ""}) == "canceled"


def test_the_submit_line_leaves_a_stale_position_to_the_following_lines():
    reply = {"job_id": "b" * 32, "state": "queued", "queue_position": 1}
    assert submitted_line(reply, following=True) == "submitted job bbbbbbbb"
    assert submitted_line(reply, following=False) == "submitted job bbbbbbbb (queue position 1 when submitted)"


# -- with a real worker -------------------------------------------------------------------------------------------
def _events(stack, job_id: str) -> list[dict]:
    """Every event of an ended job, replayed from its stream (the stream then ends)."""
    reply = stack.client.get(f"/api/v1/jobs/{job_id}/events", headers=stack.auth)
    assert reply.status_code == 200
    messages = sse_messages(reply.get_data(as_text=True).splitlines())
    events = [json.loads(data) for event, _, data in messages if event == "message"]
    assert events and events[-1]["job_state"] in ("done", "partial"), events[-1:]
    return events


@pytest.mark.slow
def test_the_khala_percentage_polled_to_the_end_never_falls_and_a_preloaded_worker_never_loads(make_stack):
    stack = make_stack(ENCORE_PRELOAD="1", ENCORE_SSE_MAX_S="5")
    stack.start_worker(0)
    accepted = requests.post(f"{stack.base_url}/generate", json=KHALA_SONG, timeout=10).json()
    assert accepted["status"] == "accepted" and accepted["queue_position"] == 0, accepted  # as the reference
    job_id, seen = accepted["job_id"], []

    def ended():
        body = requests.get(f"{stack.base_url}/job/{job_id}", timeout=5).json()
        seen.append(body)
        return body if body["status"] in ("completed", "partial") else None

    final = wait_until(ended, 240, 0.05, "the Khala job to end")
    assert final["status"] == "completed", final
    for index in (0, 1):
        tracks = [body["tracks"][index] for body in seen]
        percents = [t["progress"] for t in tracks]
        assert non_decreasing(percents), percents
        assert len(set(percents)) > 3 and percents[-1] == 100  # it was sampled on its way, not only at the end
        assert not [t for t in tracks if t["worker_phase"].startswith("loading") or "Loading" in t["phase_display"]]
        assert not [t for t in tracks if re.search(r"· [01] tok/s", t["phase_display"])], tracks
    assert not [e for e in _events(stack, job_id) if (e.get("detail") or "").startswith("loading")]
    record = stack.job(job_id)
    assert all(run["loaded"] == [] for t in record["tracks"] for run in t["stages"].values()), record["tracks"]


@pytest.mark.slow
def test_a_stage_says_loading_exactly_when_it_loads_a_model(make_stack):
    stack = make_stack(ENCORE_SSE_MAX_S="5")  # no preload: the first job's stages load their models
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=2.0)
    assert stack.wait_job(job_id)["state"] == "done"
    loading_in: dict[str, list[str]] = {}
    for event in _events(stack, job_id):
        if str(event.get("status", "")).startswith("running:") and (event.get("detail") or "").startswith("loading"):
            loading_in.setdefault(event["stage"], []).append(event["detail"])
    stages = stack.job(job_id)["tracks"][0]["stages"]
    assert "backbone" in stages["backbone"]["loaded"] and "codec" in stages["decode"]["loaded"], stages
    for name, run in stages.items():
        assert bool(loading_in.get(name)) == bool(run["loaded"]), (name, run["loaded"], loading_in)
    assert loading_in["backbone"][0] == "loading backbone model" and loading_in["decode"] == ["loading decoder model"]
