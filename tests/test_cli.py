"""`python -m app` as a real subprocess against a real stack (redis-server, one CPU worker, live HTTP server):
submit music/lip-sync with --wait (progress, downloads, exit codes), status, jobs, cancel, HTTP errors, tokens."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.support import media
from tests.support.cli import cli
from tests.support.processes import free_port, wait_until
from tests.support.stack import REFERENCE_ENGINE, Stack

pytestmark = pytest.mark.slow  # every test talks to a stack with a worker, two run jobs (~20 s here)

JOB_ID = re.compile(r"^[0-9a-f]{32}$")
REPEATED_WORD = re.compile(r"\b(\w+) \1\b")
ORDER = ["queued", "backbone", "superres", "decoding", "exporting", "done"]
LINE = re.compile(r"^track 0 (\w+)\b.*?(?: \((\d+)%\))?$")
TINY_MUSIC = [
    "submit",
    "music",
    "--mode",
    "instrumental",
    "--tags",
    "x",
    "--duration-s",
    "2",
    "--tracks",
    "1",
    "--seed",
    "5",
]


@pytest.fixture(scope="module")
def stack(redis_base_url, tiny_models, tmp_path_factory):
    """One stack and one worker for the whole module: starting a worker is the slow part."""
    stack = Stack(redis_base_url, tiny_models, tmp_path_factory.mktemp("cli-stack"), **REFERENCE_ENGINE)
    stack.start_worker(0)
    yield stack
    stack.close()


def ffprobe(path: Path) -> dict:
    probe = subprocess.run(
        ["ffprobe", "-v", "error", "-show_entries", "format=duration:stream=codec_type", "-of", "json", str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return json.loads(probe.stdout)


def test_status_shows_the_idle_worker_and_its_queue(stack):
    stack.wait_worker(0, "idle")
    result = cli(stack, "status")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.strip()}
    worker = next(row for name, row in rows.items() if name.startswith("gpu0@"))
    assert worker[1:3] == ["idle", "gpu0"], result.stdout
    assert worker[-1] == "-", result.stdout  # no current job/stage
    assert "WORKERS" in result.stdout and "QUEUES" in result.stdout
    assert rows["gpu0"][1:] == ["0", "0", "routing"], result.stdout  # queue row: nothing waiting, routed to

    raw = json.loads(cli(stack, "status", "--json").stdout)
    assert [w["status"] for w in raw["workers"]] == ["idle"]


def test_submit_music_wait_shows_bars_and_downloads_both_files(stack, tmp_path):
    out = tmp_path / "music"
    result = cli(stack, *TINY_MUSIC, "--wait", "--progress", "bars", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = result.stdout.splitlines()[0]
    assert JOB_ID.match(job_id), result.stdout
    assert result.stdout.splitlines()[1] == f"{stack.base_url}/api/v1/jobs/{job_id}"
    assert f"job {job_id} done" in result.stdout
    assert "track 0 done" in result.stderr and "100%" in result.stderr, result.stderr  # the tqdm bar ended full

    assert sorted(p.name for p in out.iterdir()) == ["track0.mp3", "track0.wav"]
    assert (out / "track0.wav").read_bytes() == stack.client.get(f"/api/v1/jobs/{job_id}/tracks/0.wav").data
    probe = ffprobe(out / "track0.mp3")
    assert [s["codec_type"] for s in probe["streams"]] == ["audio"]
    assert abs(float(probe["format"]["duration"]) - 2.0) < 0.15

    status = cli(stack, "status").stdout  # the child reported its device while it ran the job
    assert re.search(r"^gpu0@\S+\s+idle\s+gpu0\s+cpu\s", status, re.M), status

    listing = cli(stack, "jobs")
    assert listing.returncode == 0, listing.stderr
    row = next(line.split() for line in listing.stdout.splitlines() if line.startswith(job_id))
    assert row[1:4] == ["music", "done", "1"], listing.stdout


def test_submit_lipsync_wait_downloads_the_video_into_the_default_folder(stack, tmp_path):
    video = media.face_video(tmp_path / "face.mp4", seconds=3.2)
    audio = media.tone(tmp_path / "tone.wav", seconds=1.0)
    result = cli(
        stack, "submit", "lipsync", str(video), str(audio), "--fps", "10", "--batch-size", "4", "--wait", cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = result.stdout.splitlines()[0]
    assert "track 0 done" in result.stderr, result.stderr  # plain progress lines when stderr is not a terminal
    assert "\r" not in result.stderr

    output = tmp_path / f"encore-{job_id[:8]}" / "lipsync.mp4"
    assert output.stat().st_size > 0
    probe = ffprobe(output)
    assert sorted(s["codec_type"] for s in probe["streams"]) == ["audio", "video"]
    assert abs(float(probe["format"]["duration"]) - 1.0) < 0.3


def test_cancel_a_running_long_job(stack):
    stack.wait_worker(0, "idle")
    submitted = cli(
        stack, "submit", "music", "--mode", "instrumental", "--tags", "x", "--duration-s", "60", "--tracks", "1"
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id, status_url = submitted.stdout.splitlines()[:2]
    assert JOB_ID.match(job_id) and status_url.endswith(f"/api/v1/jobs/{job_id}")
    wait_until(lambda: stack.job(job_id)["state"] == "running", 60, 0.1, "the long job to start")

    result = cli(stack, "cancel", job_id, "--wait")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"job {job_id} canceled" in result.stdout
    assert stack.job(job_id)["tracks"][0]["state"] == "canceled"
    stack.wait_worker(0, "idle", timeout=30)

    waited = cli(stack, "wait", job_id, "--progress", "lines")  # says why, the state word once
    assert waited.returncode == 1, waited.stdout + waited.stderr
    ended = [line for line in waited.stderr.splitlines() if line.startswith("track 0")]
    assert len(ended) == 1 and re.fullmatch(r"track 0 canceled [(\w].*\w\)?", ended[0]), waited.stderr  # with why
    assert not REPEATED_WORD.search(waited.stderr), waited.stderr


def test_http_and_usage_errors_exit_2_with_the_servers_message(stack, tmp_path):
    bad = cli(stack, *TINY_MUSIC, "--temperature", "9")
    assert bad.returncode == 2 and "temperature" in bad.stderr, bad.stderr
    assert bad.stdout == ""
    vocal = cli(stack, "submit", "music", "--tags", "x", "--duration-s", "2")
    assert vocal.returncode == 2 and "lyrics: required in vocal mode" in vocal.stderr, vocal.stderr

    missing = cli(stack, "cancel", "0" * 32)
    assert missing.returncode == 2 and "not found" in missing.stderr and "404" in missing.stderr
    no_file = cli(stack, "submit", "lipsync", str(tmp_path / "none.mp4"), str(tmp_path / "none.wav"))
    assert no_file.returncode == 2 and "video: no such file" in no_file.stderr
    unreachable = cli(stack, "status", ENCORE_URL=f"http://127.0.0.1:{free_port()}")
    assert unreachable.returncode == 2 and "cannot reach Encore" in unreachable.stderr
    # --url wins over ENCORE_URL, before or after the subcommand.
    dead = f"http://127.0.0.1:{free_port()}"
    assert cli(stack, "status", "--url", stack.base_url, ENCORE_URL=dead).returncode == 0
    assert cli(stack, "--url", stack.base_url, "status", ENCORE_URL=dead).returncode == 0


def test_token_from_flag_or_env_and_401_without_it(make_stack):
    secured = make_stack(API_TOKEN="s3cret")  # no worker needed: submitted jobs just wait
    missing = cli(secured, "status")
    assert missing.returncode == 2 and "authorization" in missing.stderr and "401" in missing.stderr
    wrong = cli(secured, "status", "--token", "nope")
    assert wrong.returncode == 2 and "authorization" in wrong.stderr
    assert cli(secured, "status", "--token", "s3cret").returncode == 0

    submitted = cli(secured, *TINY_MUSIC, ENCORE_API_TOKEN="s3cret")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.splitlines()[0]
    record = secured.client.get(f"/api/v1/jobs/{job_id}", headers={"Authorization": "Bearer s3cret"}).get_json()
    assert record["tracks"][0]["state"] == "queued", record
    canceled = cli(secured, "cancel", job_id, "--token", "s3cret")
    assert canceled.returncode == 0 and f"job {job_id} canceled" in canceled.stdout, canceled.stderr


# Server variables a client machine may well carry (a shared .env, a worker host), each one malformed.
BROKEN_SERVER_ENV = {
    "ENCORE_ETA_ALPHA": "7",
    "ENCORE_LEASE_S": "soon",
    "ENCORE_RUNTIME_MODE": "sometimes",
    "REDIS_SENTINELS": "not a host list:x",
    "ENCORE_SUBMIT_RATE_LIMIT": "lots",
}


def test_the_cli_reads_only_its_own_settings(make_stack):
    """Malformed server variables in the client's environment change nothing: it reads ENCORE_URL and
    ENCORE_API_TOKEN alone (it used to build the server's whole Settings and die on a ValueError)."""
    secured = make_stack(API_TOKEN="s3cret")  # no worker needed: a submitted job just waits
    submitted = cli(secured, *TINY_MUSIC, ENCORE_API_TOKEN="s3cret", **BROKEN_SERVER_ENV)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.splitlines()[0]
    assert JOB_ID.match(job_id), submitted.stdout
    listed = cli(secured, "jobs", "--json", ENCORE_API_TOKEN="s3cret", **BROKEN_SERVER_ENV)
    assert listed.returncode == 0, listed.stderr
    assert [job["job_id"] for job in json.loads(listed.stdout)] == [job_id]
    refused = cli(secured, "jobs", **BROKEN_SERVER_ENV)  # the token comes from ENCORE_API_TOKEN or nowhere
    assert refused.returncode == 2 and "401" in refused.stderr, refused.stderr


def test_wait_follows_the_event_stream_and_polling_stays_the_fallback(stack, tmp_path):
    streamed = cli(stack, *TINY_MUSIC, "--wait", "--progress", "lines", "--out", str(tmp_path / "a"))
    assert streamed.returncode == 0, streamed.stdout + streamed.stderr
    assert "via server-sent events" in streamed.stderr and "by polling" not in streamed.stderr
    lines = streamed.stderr.splitlines()
    assert any("track 0 backbone" in line for line in lines) and "track 0 done" in lines[-1], streamed.stderr
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["track0.mp3", "track0.wav"]

    polled = cli(stack, *TINY_MUSIC, "--wait", "--poll", "--progress", "lines", "--out", str(tmp_path / "b"))
    assert polled.returncode == 0 and "server-sent events" not in polled.stderr, polled.stderr
    assert (tmp_path / "b" / "track0.wav").stat().st_size > 0


def test_wait_on_a_running_job_starts_at_its_current_state_and_only_moves_forward(stack, tmp_path):
    """`wait` joined to a job part-way through its backbone: its first line is the state the job is in (not the
    replayed "queued 0%"), then states and the track's percentage only go forward to `done`; no stage prints
    "waiting for the worker (0%)", and no line says a word twice."""
    stack.wait_worker(0, "idle")
    job_id = stack.submit_music(duration_s=30.0, num_tracks=1, seed=3)

    def into_backbone():
        track = stack.job(job_id)["tracks"][0]
        return (
            track if track["state"] != "queued" and (track["state"] != "backbone" or track["progress"] >= 0.2) else None
        )

    joined_at = ORDER.index(wait_until(into_backbone, 120, 0.05, "the backbone to be a fifth done")["state"])
    result = cli(stack, "wait", job_id, "--progress", "lines", "--out", str(tmp_path / "out"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [m for m in map(LINE.match, result.stderr.splitlines()) if m]
    states = [ORDER.index(m.group(1)) for m in lines]
    percents = [int(m.group(2)) for m in lines if m.group(2)]
    assert states and states[0] >= joined_at >= 1 and states[-1] == ORDER.index("done"), result.stderr
    assert states == sorted(states) and percents == sorted(percents), result.stderr  # forward only
    assert percents[0] >= 5, result.stderr  # a fifth of the backbone, the first of four parts, is done
    assert "waiting for the worker" not in result.stderr and not REPEATED_WORD.search(result.stderr), result.stderr
