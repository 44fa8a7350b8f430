"""`python -m app` as a real subprocess against a real stack (redis-server, one CPU worker, live HTTP server):
submit music/lip-sync with --wait (progress, downloads, exit codes), status, jobs, cancel, HTTP errors, tokens;
the bars on a real pseudo-terminal; the installed `encore` command, and the package a non-editable install
ships."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import time
import zipfile
from pathlib import Path

import pytest

from harness import media
from harness.cli import cli
from harness.processes import REPO, free_port, wait_until
from harness.stack import REFERENCE_ENGINE, Stack

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


# -- on a terminal ------------------------------------------------------------------------------------------------
CSI = re.compile(r"\x1b\[([0-9;?]*)([@-~])")


def screen(raw: bytes, columns: int, rows: int) -> list[str]:
    """The lines a terminal `columns` x `rows` shows after `raw` (its scrollback included), as xterm draws them:
    a character in the last column leaves the cursor there until the next one wraps; CR, LF, BS, cursor up and
    down (CSI A/B, bounded by the screen) and erase in line (CSI K) are followed; other sequences are ignored."""
    lines: list[list[str]] = [[]]
    row = col = top = 0
    text = raw.decode("utf-8", "replace")
    i = 0

    def line_feed() -> None:
        nonlocal row, col, top
        row, col = row + 1, min(col, columns - 1)
        while len(lines) <= row:
            lines.append([])
        top = max(top, row - rows + 1)

    while i < len(text):
        ch = text[i]
        if ch == "\x1b":
            match = CSI.match(text, i)
            if match is None:
                i += 2  # a two-character escape (ESC 7, ESC =, ...)
                continue
            param, final = match.group(1), match.group(2)
            count = int(param) if param.isdigit() else 1
            if final == "A":
                row, col = max(top, row - count), min(col, columns - 1)
            elif final == "B":
                for _ in range(count):
                    if row < top + rows - 1:
                        line_feed()
            elif final == "K":
                cells = lines[row]
                if param in ("", "0"):
                    del cells[col:]
                elif param == "1":
                    cells[: col + 1] = [" "] * min(col + 1, len(cells))
                else:
                    cells.clear()
            i = match.end()
            continue
        i += 1
        if ch == "\r":
            col = 0
        elif ch == "\n":
            line_feed()
        elif ch == "\b":
            col = max(0, min(col, columns - 1) - 1)
        elif ch >= " ":
            if col >= columns:  # the previous character filled the last column: this one wraps
                col = 0
                line_feed()
            cells = lines[row]
            cells.extend(" " * (col + 1 - len(cells)))
            cells[col] = ch
            col += 1
    return ["".join(cells).rstrip() for cells in lines]


def on_terminal(
    stack: Stack, *args: str, cwd: Path, columns: int = 120, rows: int = 30, timeout: float = 180
) -> tuple[int, bytes]:
    """Run the CLI with its standard output and error on a pseudo-terminal `columns` x `rows` (as in a terminal
    window: tqdm sizes its bars from it); its exit status and every byte it wrote there."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    environ = {k: v for k, v in os.environ.items() if k not in ("ENCORE_API_TOKEN", "COLUMNS", "LINES")}
    environ.update({"ENCORE_URL": stack.base_url, "PYTHONPATH": str(REPO), "TERM": "xterm"})
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "app", *args],
            cwd=cwd,
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
        )
    finally:
        os.close(slave)
    output = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it (the child ended)
                break
            if not chunk:
                break
            output += chunk
        else:
            child.kill()
            pytest.fail(f"the CLI did not end within {timeout} s on its terminal: {bytes(output)[-2000:]!r}")
        return child.wait(timeout=30), bytes(output)
    finally:
        os.close(master)


TWO_TINY_TRACKS = [*TINY_MUSIC[: TINY_MUSIC.index("--tracks")], "--tracks", "2", "--seed", "5"]


def test_on_a_terminal_the_following_line_has_a_screen_line_of_its_own(stack, tmp_path):
    """Issue 36 #19: the "following job ... via server-sent events" line was printed while the first bar was
    drawn, right after it on the bar's line (tqdm redraws in place, no newline): on a 120-column terminal
    "... 0% 00:00f" / "ollowing job ...", left on screen. It goes above the bars now, a line of its own."""
    stack.wait_worker(0, "idle")
    status, raw = on_terminal(stack, *TWO_TINY_TRACKS, "--wait", "--out", str(tmp_path / "out"), cwd=tmp_path)
    lines = screen(raw, columns=120, rows=30)
    shown = "\n".join(lines)
    assert status == 0, shown
    assert JOB_ID.match(lines[0]), shown
    following = f"following job {lines[0][:8]} via server-sent events"
    assert lines.count(following) == 1, shown  # a whole line, nothing of a bar before or after it
    assert sum("ollowing" in line for line in lines) == 1, shown  # and no fragment of it anywhere else
    assert "\r" in raw.decode(errors="replace") and re.search(r"\d% \d\d:\d\d", shown), shown  # bars were drawn
    bars = [line for line in lines if re.search(r"\d+% \d\d:\d\d$", line)]
    assert bars and all(re.match(r"track [01] ", line) for line in bars), shown  # every bar line is a bar alone
    assert lines.index(following) < lines.index(bars[0]), shown  # above the bars
    for track in (0, 1):  # what stays on screen of each track is its final bar, once
        assert [line for line in lines if line.startswith(f"track {track} ")] == [
            next(line for line in bars if line.startswith(f"track {track} done ") and " 100% " in line)
        ], shown
    assert f"job {lines[0]} done" in shown, shown


# -- the installed command ----------------------------------------------------------------------------------------
def run_in(cwd: Path, *command: str, **env: str) -> subprocess.CompletedProcess:
    """A command run in `cwd` where `app` is importable only as installed: no PYTHONPATH to the project."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ENCORE_API_TOKEN")}
    return subprocess.run(
        command, cwd=cwd, env={**environ, **env}, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_encore_command_works_from_any_folder(stack, tmp_path):
    """Issue 36 #20: `python -m app` worked only from the project's folder ("No module named app" elsewhere).
    scripts/setup.sh installs the project into .venv: the `encore` command, and `python -m app`, from anywhere."""
    encore = Path(sys.executable).parent / "encore"
    assert encore.is_file(), "scripts/setup.sh installs the project into .venv: .venv/bin/encore"
    helped = run_in(tmp_path, str(encore), "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: encore "), helped.stdout + helped.stderr
    listed = run_in(tmp_path, str(encore), "status", ENCORE_URL=stack.base_url)
    assert listed.returncode == 0 and "WORKERS" in listed.stdout and "gpu0" in listed.stdout, listed.stderr

    module = run_in(tmp_path, sys.executable, "-m", "app", "jobs", ENCORE_URL=stack.base_url)
    assert module.returncode == 0 and module.stdout.startswith(("ID", "no jobs")), (
        module.stderr
    )  # "No module named app"
    helped = run_in(REPO, sys.executable, "-m", "app", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: python -m app "), helped.stdout + helped.stderr


def test_events_runs_the_http_layers_server_entry_under_both_names(tmp_path):
    """Issue 37 #7: the events server's entry and its --bind live in the HTTP layer (app/http/events_server.py),
    which `python -m app events` reaches through app/__main__.py; `encore events` hands its arguments over to it
    (the client imports no server code). Both show the server's own options and reach its bind check; the client's
    help still lists `events`, and its other commands refuse the server's options. The server really serving is
    tests/test_events_server.py's (started as harness/stack.py does, `python -m app events --bind`)."""
    encore = str(Path(sys.executable).parent / "encore")
    for command in (
        (sys.executable, "-m", "app", "events"),
        (encore, "events"),
        (encore, "--url", "http://127.0.0.1:9", "events"),
    ):
        helped = run_in(tmp_path, *command, "--help")
        assert helped.returncode == 0, helped.stderr
        assert helped.stdout.startswith("usage: python -m app events [-h] [--bind BIND]"), helped.stdout
        refused = run_in(tmp_path, *command, "--bind", "nowhere")
        assert refused.returncode != 0 and "ENCORE_EVENTS_BIND: 'nowhere' is not host:port" in refused.stderr, (
            refused.stderr
        )
    listed = run_in(tmp_path, sys.executable, "-m", "app", "--help")
    assert listed.returncode == 0 and "run the events server" in listed.stdout and "--bind" not in listed.stdout
    mistaken = run_in(tmp_path, encore, "jobs", "--bind", "127.0.0.1:8001")
    assert mistaken.returncode == 2 and "unrecognized arguments: --bind 127.0.0.1:8001" in mistaken.stderr


def test_a_wheel_of_the_project_ships_every_file_of_app_and_the_command(tmp_path):
    """`pip install .` (a client machine, an image) installs from a wheel, not from the work tree: every file of
    app/ that git tracks must be in it (the Lua scripts, khala_tags.json, the page's static files, app.tasks
    without an __init__.py), and the `encore` entry point. Built from the tracked files alone, as a clean clone."""
    tracked = subprocess.run(
        ["git", "ls-files", "pyproject.toml", "app"], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    source = tmp_path / "clone"
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("encore-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    shipped = sorted(n for n in names if n.startswith("app/"))
    assert shipped == sorted(n for n in tracked if n.startswith("app/")), set(tracked) ^ set(shipped)
    assert re.search(r"^encore = app\.clients\.cli:main$", entry_points, re.M), entry_points
