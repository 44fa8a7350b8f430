"""Command-line client for Encore's HTTP API: submit, follow, download, cancel, inspect.

    encore submit music --tags "lo-fi, piano" --mode instrumental --duration-s 10 --wait
    encore submit lipsync face.mp4 speech.wav --fps 25 --wait --out out/synced
    encore status | jobs | wait ID | cancel ID

`encore` is the command pyproject.toml installs (scripts/setup.sh installs the project into .venv); `python -m app`
is the same client where the `app` package is importable (the project's folder, or any folder once installed).

It only speaks HTTP (base URL from --url / ENCORE_URL, token from --token / ENCORE_API_TOKEN), so it works
against any deployment; nothing heavy (torch, Flask, Redis) is imported. Exit codes: 0 the job is done (or
the command succeeded), 1 the job ended failed / canceled / partial, 2 usage or HTTP error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Mapping, Protocol, Sequence, cast

import requests
from tqdm import tqdm

from app.core.config import DEFAULT_WEB_URL
from app.core.kinds import JOB_END_STATES, KINDS, QUEUED, TERMINAL_STATES
from app.core.priority import PRIORITIES
from app.core.tenants import token_digest

EXIT_OK, EXIT_JOB_NOT_DONE, EXIT_ERROR = 0, 1, 2
RETRY_WINDOW_S = 30.0  # while following a job, ride out a web restart or a network blip this long


class ApiError(Exception):
    """An HTTP error or an unreachable server, with the server's own `error` message when it sent one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        return self.status is None or self.status >= 500


@dataclass(frozen=True)
class ClientSettings:
    """The client's own two settings, read alone: a client machine's environment may hold the server's
    variables too (a shared .env, a worker host), and their values are none of the client's business."""

    url: str = DEFAULT_WEB_URL  # ENCORE_URL
    token: str | None = None  # ENCORE_API_TOKEN

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "ClientSettings":
        return cls(url=environ.get("ENCORE_URL", DEFAULT_WEB_URL), token=environ.get("ENCORE_API_TOKEN") or None)


# -- HTTP ---------------------------------------------------------------------------------------------------
@dataclass
class Client:
    """Thin wrapper over requests: base URL, bearer token, and errors turned into ApiError."""

    base_url: str
    token: str | None = None
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self.session = requests.Session()
        if self.token:
            self.session.headers["Authorization"] = f"Bearer {self.token}"

    def url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else f"{self.base_url}{path}"

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", self.timeout_s)
        try:
            reply = self.session.request(method, self.url(path), **kwargs)
        except requests.RequestException as exc:
            raise ApiError(f"cannot reach Encore at {self.base_url} ({_reason(exc)})") from exc
        if reply.status_code >= 400:
            raise ApiError(_error_message(reply), reply.status_code)
        return reply

    def json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        return self.request(method, path, **kwargs).json()

    def download(self, path: str, target: Path) -> int:
        """Stream a file to `target` (via a .part file, so a broken transfer never looks complete)."""
        part = target.with_name(target.name + ".part")
        with self.request("GET", path, stream=True) as reply, open(part, "wb") as out:
            for chunk in reply.iter_content(1 << 20):
                out.write(chunk)
        part.replace(target)
        return target.stat().st_size


def _reason(exc: requests.RequestException) -> str:
    """The innermost cause in a few words (urllib3's wrapped messages are a paragraph long)."""
    cause: BaseException = exc
    while cause.__context__ is not None and cause.__context__ is not cause:
        cause = cause.__context__
    text = str(cause).split("] ", 1)[-1] if "] " in str(cause) else str(cause)
    return text[:160] or type(exc).__name__


def _error_message(reply: requests.Response) -> str:
    try:
        body = reply.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("error"):
        return f"{body['error']} (HTTP {reply.status_code})"
    return f"HTTP {reply.status_code}: {reply.text.strip()[:200] or reply.reason}"


# -- progress ------------------------------------------------------------------------------------------------
def describe(track: dict[str, Any], kind: str) -> str:
    """One line for a track: its state, where a queued track stands, or the running stage and its detail."""
    state, index = track["state"], track["track"]
    if state == QUEUED:
        position, queue = track.get("queue_position") or 0, track.get("queue") or ""
        if not queue:
            return f"track {index} queued ({track.get('detail') or 'waiting for a worker'})"
        return f"track {index} queued #{position} on {queue}" if position else f"track {index} queued on {queue}"
    if state in ("failed", "canceled"):
        return f"track {index} {ended_reason(track)}"
    states = stage_states(kind)
    if state in states:
        return f"track {index} {state} [{states.index(state) + 1}/{len(states)}] {track.get('detail') or ''}".rstrip()
    return f"track {index} {state}"


def ended_reason(track: dict[str, Any]) -> str:
    """A failed or canceled track's state and why, the state word said once: the lifecycle's details already
    start with it ("canceled during backbone"), and a cancel leaves `error` empty (its reason is the detail)."""
    state = track["state"]
    reason = str(track.get("error") or track.get("detail") or "").strip()
    if not reason or reason == state:
        return state
    return reason if reason.split()[0].rstrip(":") == state else f"{state}: {reason}"


def stage_states(kind: str) -> list[str]:
    """The track states of `kind`'s stages, in order (none for a kind this client does not know)."""
    return [stage.state for stage in KINDS[kind].stages] if kind in KINDS else []


def track_fraction(track: dict[str, Any], kind: str) -> float:
    """How far the track is through its whole chain, 0..1: stages finished plus the running stage's own
    progress, each stage an equal part (the line says which, [k/n]). It only grows as stages follow each other
    (a stage's end and the next one's start are the same figure), where the stage's own progress falls back to
    0 at each new stage; a track that waits to resume counts the stages it has finished."""
    states = stage_states(kind)
    if track["state"] == "done" or not states:
        return 1.0 if track["state"] == "done" else 0.0
    if track["state"] in states:
        progress = min(max(float(track.get("progress") or 0), 0.0), 1.0)
        return (states.index(track["state"]) + progress) / len(states)
    finished = sum(
        1 for run in (track.get("stages") or {}).values() if isinstance(run, dict) and run.get("finished_at")
    )
    return min(finished, len(states)) / len(states)


def between_stages(track: dict[str, Any]) -> bool:
    """True while a track whose stage finished waits for its next one to start (status `waiting:<stage>`): a
    moment with nothing to report (its detail says only "waiting for the worker", at 0 % of a stage not begun)."""
    return str(track.get("status") or "").startswith("waiting:")


class Reporter(Protocol):
    def update(self, record: dict[str, Any]) -> None: ...
    def note(self, message: str) -> None: ...
    def close(self) -> None: ...


class BarReporter:
    """One tqdm bar per track showing its progress over its whole chain (track_fraction, so the bar never runs
    back at a stage change); the description is state + detail."""

    WIDTH = 52

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.bars: dict[int, tqdm] = {}

    def update(self, record: dict[str, Any]) -> None:
        for track in record["tracks"]:
            text = describe(track, record["kind"])[: self.WIDTH].ljust(self.WIDTH)
            bar = self.bars.get(track["track"])
            if bar is None:
                bar = self.bars[track["track"]] = tqdm(
                    desc=text,
                    total=100,
                    position=track["track"],
                    leave=True,
                    file=self.stream,
                    dynamic_ncols=True,
                    bar_format="{desc} {bar} {percentage:3.0f}% {elapsed}",
                )
            bar.set_description_str(text, refresh=False)
            bar.n = round(100 * track_fraction(track, record["kind"]))
            bar.refresh()

    def note(self, message: str) -> None:
        """A line of its own above the bars. Printed plainly it would land after the cursor, which sits at the end
        of a bar (tqdm redraws a bar in place with \\r, no newline): the message glued to the bar, wrapped on a
        narrow terminal, and left behind on screen as the bars moved on. tqdm.write clears the bars, prints the
        line and draws them again below it."""
        tqdm.write(message, file=self.stream)
        self.stream.flush()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


class LineReporter:
    """For logs and pipes: one line per track whenever its state, its queue position or whether its stage is
    loading a model changes. A track between two stages prints nothing (the next stage's start does)."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.seen: dict[int, tuple[Any, ...]] = {}

    def update(self, record: dict[str, Any]) -> None:
        for track in record["tracks"]:
            if between_stages(track):
                continue
            loading = str(track.get("detail") or "").startswith("loading ")
            key = (track["state"], track.get("queue_position"), track.get("queue"), loading)
            if self.seen.get(track["track"]) != key:
                self.seen[track["track"]] = key
                self.note(describe(track, record["kind"]) + _percent(track, record["kind"]))

    def note(self, message: str) -> None:
        print(message, file=self.stream, flush=True)

    def close(self) -> None:
        pass


def _percent(track: dict[str, Any], kind: str) -> str:
    """The track's progress over its chain while it is open; nothing once it has ended (it would only confuse)."""
    return "" if track["state"] in TERMINAL_STATES else f" ({100 * track_fraction(track, kind):.0f}%)"


def make_reporter(mode: str) -> Reporter:
    """Bars on a terminal, plain lines otherwise (or as forced with --progress)."""
    if mode == "bars" or (mode == "auto" and sys.stderr.isatty()):
        return BarReporter()
    return LineReporter()


# -- following and downloading --------------------------------------------------------------------------------
def fetch_record(client: Client, job_id: str) -> dict[str, Any]:
    """GET the job record, retrying transient failures (server down, 5xx) for RETRY_WINDOW_S."""
    deadline = time.monotonic() + RETRY_WINDOW_S
    while True:
        try:
            return client.json("GET", f"/api/v1/jobs/{job_id}")
        except ApiError as exc:
            if not exc.transient or time.monotonic() > deadline:
                raise
        time.sleep(1.0)


def follow(client: Client, job_id: str, reporter: Reporter, interval_s: float, events: bool = True) -> dict[str, Any]:
    """Follow the job until it ends, feeding records to the reporter: through its server-sent events, or by
    polling when the server has none (an older Encore, a proxy that refuses streams) or `events` is off."""
    if events:
        try:
            return follow_events(client, job_id, reporter, interval_s)
        except StreamUnavailable as exc:
            reporter.note(f"following job {job_id[:8]} by polling ({exc})")
    return poll(client, job_id, reporter, interval_s)


def poll(client: Client, job_id: str, reporter: Reporter, interval_s: float) -> dict[str, Any]:
    """Poll the job until it ends, feeding every record to the reporter."""
    while True:
        record = fetch_record(client, job_id)
        reporter.update(record)
        if record["state"] in JOB_END_STATES:
            return record
        time.sleep(interval_s)


class StreamUnavailable(Exception):
    """The server answers no event stream for the job (or it keeps failing): poll instead."""


EVENT_STREAM_READ_S = 60.0  # several heartbeats: a stream silent this long is dead, and is reopened
EVENT_STREAM_RETRIES = 3


def sse_messages(lines: Iterable[str]) -> Iterator[tuple[str, str | None, str]]:
    """(event name, id, data) per server-sent message; comments (heartbeats) and `retry:` skipped."""
    event: str = "message"
    event_id: str | None = None
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield event, event_id, "\n".join(data)
            event, event_id, data = "message", None, []
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "id":
            event_id = value
        elif name == "data":
            data.append(value)


def follow_events(client: Client, job_id: str, reporter: Reporter, interval_s: float) -> dict[str, Any]:
    """Follow GET /api/v1/jobs/<id>/events to `event: end`: each event updates its track in the last record
    (a full record is fetched at most every `interval_s`, and at the end); a dropped stream is reopened with
    Last-Event-ID, so nothing is missed."""
    record = fetch_record(client, job_id)
    reporter.update(record)
    if record["state"] in JOB_END_STATES:
        return record
    reporter.note(f"following job {job_id[:8]} via server-sent events")
    last_id: str | None = None
    fetched, failures = time.monotonic(), 0
    while True:
        headers = {"Accept": "text/event-stream", **({"Last-Event-ID": last_id} if last_id else {})}
        try:
            with client.session.get(
                client.url(f"/api/v1/jobs/{job_id}/events"),
                headers=headers,
                stream=True,
                timeout=(client.timeout_s, EVENT_STREAM_READ_S),
            ) as reply:
                if reply.status_code != 200 or not reply.headers.get("Content-Type", "").startswith(
                    "text/event-stream"
                ):
                    raise StreamUnavailable(f"events answered HTTP {reply.status_code}")
                # chunk_size=None: each line as soon as it arrives (requests allows it; its stubs do not)
                lines = cast(Iterator[str], reply.iter_lines(chunk_size=None, decode_unicode=True))  # type: ignore[call-overload]
                for event, event_id, data in sse_messages(lines):
                    if event == "end":
                        record = fetch_record(client, job_id)
                        reporter.update(record)
                        return record
                    last_id, failures = event_id or last_id, 0
                    if time.monotonic() - fetched >= interval_s:
                        record, fetched = fetch_record(client, job_id), time.monotonic()
                    else:
                        record = with_event(record, json.loads(data))
                    reporter.update(record)
        except requests.RequestException as exc:
            failures += 1
            if failures > EVENT_STREAM_RETRIES:
                raise StreamUnavailable(f"the event stream kept failing: {_reason(exc)}") from exc
            time.sleep(1.0)
        # the stream ended without `end` (its server-side bound, a restart): reopen it where it stopped


def with_event(record: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    """The record with one track event applied (its state, progress, detail, error, version), and the job's
    state. An event no newer than what the record shows of its track (the track's `version`) changes nothing: a
    stream opened from its start replays the job's history, and what a client shows only moves forward."""
    track = next((t for t in record["tracks"] if t["track"] == event.get("track")), None)
    if track is None or int(event.get("version") or 0) <= int(track.get("version") or 0):
        return record
    fields = ("state", "status", "stage", "progress", "detail", "error", "version")
    tracks = [dict(t, **{k: event[k] for k in fields if k in event}) if t is track else t for t in record["tracks"]]
    return {**record, "tracks": tracks, "state": event.get("job_state", record["state"])}


def output_name(kind: str, track: int, fmt: str) -> str:
    return "lipsync.mp4" if kind == "lipsync" and fmt == "mp4" else f"track{track}.{fmt}"


def download_results(client: Client, record: dict[str, Any], out: Path) -> list[Path]:
    """Every file of every finished track, named track<i>.<fmt> (music) or lipsync.mp4."""
    out.mkdir(parents=True, exist_ok=True)
    saved = []
    for track in record["tracks"]:
        if track["state"] != "done":
            continue
        for fmt, url in sorted(track.get("downloads", {}).items()):
            target = out / output_name(record["kind"], track["track"], fmt)
            client.download(url, target)
            saved.append(target)
    return saved


def wait_and_download(client: Client, job_id: str, args: argparse.Namespace) -> int:
    """Follow a job to its end, download what finished, report; the exit code says whether it is done."""
    reporter = make_reporter(args.progress)
    started = time.monotonic()
    try:
        record = follow(client, job_id, reporter, args.interval, events=not args.poll)
    except KeyboardInterrupt:
        reporter.close()
        hint = f"{getattr(args, 'prog', 'encore')} cancel {job_id}"
        print(f"\nstopped following; job {job_id} keeps running ({hint})", file=sys.stderr)
        return 130
    finally:
        reporter.close()  # idempotent; also closes the bars when an ApiError escapes
    for track in record["tracks"] if not isinstance(reporter, LineReporter) else []:  # lines said it already
        if track["state"] != "done":
            print(describe(track, record["kind"]), file=sys.stderr)
    out = args.out or Path(f"encore-{job_id[:8]}")
    saved = download_results(client, record, out) if any(t["state"] == "done" for t in record["tracks"]) else []
    print(f"job {job_id} {record['state']} after {time.monotonic() - started:.1f} s")
    for path in saved:
        print(f"  {path}  {path.stat().st_size / 1024:.0f} KiB")
    return EXIT_OK if record["state"] == "done" else EXIT_JOB_NOT_DONE


def submitted(client: Client, reply: dict[str, Any], args: argparse.Namespace) -> int:
    """After a 202: print the id and status URL, then follow the job when --wait was given."""
    job_id = reply["job_id"]
    print(job_id)
    print(client.url(reply["status_url"]))
    print(submitted_line(reply, following=args.wait), file=sys.stderr)
    return wait_and_download(client, job_id, args) if args.wait else EXIT_OK


def submitted_line(reply: dict[str, Any], following: bool) -> str:
    """What the 202 said of the job. Its queue position is the one it had when submitted: a job at the head of
    an idle worker's queue runs a few milliseconds later, so a client that follows the job leaves it out and
    shows the job's current state next (a queued track's position among them), never "queue position 1" for a
    job that is running; one that does not follow prints it, as of the submission."""
    where = reply.get("state", "")
    if reply.get("queue_position") and reply.get("state") == QUEUED and not following:
        where = f"queue position {reply['queue_position']} when submitted"
    note = f"; {reply['note']}" if reply.get("note") else ""
    return f"submitted job {reply['job_id'][:8]}" + (f" ({where})" if where and not following else "") + note


# -- commands --------------------------------------------------------------------------------------------------
def music_body(args: argparse.Namespace) -> dict[str, Any]:
    """The POST /api/v1/music body: only the options given, so the server's defaults apply to the rest."""
    lyrics = args.lyrics_file.read_text(encoding="utf-8") if args.lyrics_file else args.lyrics
    fields = {
        "mode": args.mode,
        "tags": args.tags,
        "prompt": args.prompt,
        "lyrics": lyrics,
        "duration_s": args.duration_s,
        "num_tracks": args.tracks,
        "seed": args.seed,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "priority": args.priority,
    }
    return {name: value for name, value in fields.items() if value is not None}


def cmd_submit_music(client: Client, args: argparse.Namespace) -> int:
    if args.lyrics_file and not args.lyrics_file.is_file():
        raise UsageError(f"--lyrics-file: no such file: {args.lyrics_file}")
    reply = client.json("POST", "/api/v1/music", json=music_body(args))
    return submitted(client, reply, args)


def cmd_submit_lipsync(client: Client, args: argparse.Namespace) -> int:
    for name, path in (("video", args.video), ("audio", args.audio)):
        if not path.is_file():
            raise UsageError(f"{name}: no such file: {path}")
    form = {
        name: str(value)
        for name, value in (
            ("fps", args.fps),
            ("extra_margin", args.extra_margin),
            ("batch_size", args.batch_size),
            ("priority", args.priority),
        )
        if value is not None
    }
    with open(args.video, "rb") as video, open(args.audio, "rb") as audio:
        files: dict[str, tuple[str, BinaryIO]] = {"video": (args.video.name, video), "audio": (args.audio.name, audio)}
        reply = client.json("POST", "/api/v1/lipsync", data=form, files=files, timeout=max(client.timeout_s, 300))
    return submitted(client, reply, args)


def cmd_wait(client: Client, args: argparse.Namespace) -> int:
    fetch_record(client, args.job_id)  # a 404 ends here, before any progress output
    return wait_and_download(client, args.job_id, args)


def cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    """Request the cancel; 0 when the job ends (or is ending) canceled, 1 when it had already ended."""
    record = client.json("DELETE", f"/api/v1/jobs/{args.job_id}")
    if args.wait:
        record = follow(client, args.job_id, LineReporter(), args.interval, events=not args.poll)
    ended_otherwise = record["state"] in ("done", "failed") or (
        record["state"] == "partial" and not any(t["state"] == "canceled" for t in record["tracks"])
    )
    states = ", ".join(f"{t['track']}:{t['state']}" for t in record["tracks"])
    print(f"job {args.job_id} {record['state']} (tracks {states})")
    if ended_otherwise:
        print(f"job had already ended {record['state']}; nothing to cancel", file=sys.stderr)
        return EXIT_JOB_NOT_DONE
    return EXIT_OK


def cmd_retry(client: Client, args: argparse.Namespace) -> int:
    """Re-run the job's failed or canceled tracks; with --wait follow it and download as `wait` does."""
    reply = client.json("POST", f"/api/v1/jobs/{args.job_id}/retry")
    print(f"job {args.job_id}: retrying track(s) {', '.join(map(str, reply['retried']))}")
    return wait_and_download(client, args.job_id, args) if args.wait else EXIT_OK


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (no terminal library needed, reads fine in logs)."""
    cells = [[str(h).upper() for h in headers]] + [["-" if v is None or v == "" else str(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def current_work(worker: dict[str, Any], now: float) -> str:
    current = worker.get("current")
    if not current:
        return ""
    return f"{current['job_id'][:8]} track {current['track']} {current['stage']} ({now - current['since']:.0f} s)"


def gpu_memory(worker: dict[str, Any]) -> str:
    free, total = worker.get("gpu_free_bytes"), worker.get("gpu_total_bytes")
    return f"{(total - free) / 2**30:.1f}/{total / 2**30:.1f} GiB" if free is not None and total else ""


def cmd_drain(client: Client, args: argparse.Namespace) -> int:
    reply = client.json("POST", f"/api/v1/queues/{args.queue}/drain")
    print(f"queue {reply['queue']} draining: {reply['moved']} waiting track(s) moved to other queues")
    return EXIT_OK


def cmd_resume(client: Client, args: argparse.Namespace) -> int:
    reply = client.json("DELETE", f"/api/v1/queues/{args.queue}/drain")
    print(f"queue {reply['queue']} takes new tracks again")
    return EXIT_OK


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    status = client.json("GET", "/api/v1/status")
    if args.json:
        print(json.dumps(status, indent=2))
        return EXIT_OK
    now = status.get("time") or time.time()
    workers = [
        (w["name"], w["status"], w.get("queue"), w.get("device"), gpu_memory(w), current_work(w, now))
        for w in status["workers"]
    ]
    queues = [
        (q["name"], q["waiting"], q["outstanding"], "draining" if q.get("draining") else "routing")
        for q in status["queues"]
    ]
    print("WORKERS" if workers else "WORKERS: none registered")
    if workers:
        print(format_table(["name", "status", "queue", "device", "gpu mem", "current job/stage"], workers))
    print("\nQUEUES" if queues else "\nQUEUES: none")
    if queues:
        print(format_table(["name", "waiting", "outstanding", "new tracks"], queues))
    if status.get("unrouted"):
        print(f"\n{status['unrouted']} track(s) waiting for a worker to start")
    return EXIT_OK


def cmd_jobs(client: Client, args: argparse.Namespace) -> int:
    jobs = client.json("GET", "/api/v1/jobs", params={"limit": args.limit})["jobs"]
    if args.json:
        print(json.dumps(jobs, indent=2))
        return EXIT_OK
    rows = [
        (
            j["job_id"],
            j["kind"],
            j["state"],
            j["num_tracks"],
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j["created_at"])),
        )
        for j in jobs
    ]
    print(format_table(["id", "kind", "state", "tracks", "created"], rows) if rows else "no jobs")
    return EXIT_OK


# -- argument parsing ------------------------------------------------------------------------------------------
class UsageError(Exception):
    """Bad input caught before any request is sent (exit 2, like argparse's own errors)."""


def add_connection_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """--url/--token both before and after the subcommand; the subcommand copies must not reset them."""
    settings = None if suppress else ClientSettings.from_env()
    url = argparse.SUPPRESS if settings is None else settings.url
    token = argparse.SUPPRESS if settings is None else settings.token
    parser.add_argument("--url", default=url, help=f"Encore base URL (env ENCORE_URL, default {DEFAULT_WEB_URL})")
    parser.add_argument("--token", default=token, help="API token, sent as a Bearer header (env ENCORE_API_TOKEN)")


def add_wait_options(parser: argparse.ArgumentParser, with_flag: bool = True) -> None:
    if with_flag:
        parser.add_argument("--wait", action="store_true", help="follow progress until the job ends and download")
    parser.add_argument("--out", type=Path, help="download folder (default ./encore-<jobid8>/)")
    parser.add_argument(
        "--progress",
        choices=["auto", "bars", "lines"],
        default="auto",
        help="progress display: bars on a terminal, lines otherwise (default auto)",
    )
    parser.add_argument(
        "--interval", type=float, default=0.25, help="seconds between record reads while following (default 0.25)"
    )
    parser.add_argument(
        "--poll", action="store_true", help="poll the job record instead of following its server-sent events"
    )


def add_priority_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--priority",
        choices=PRIORITIES,
        help="orders the job's first stage among those waiting (the server's default: normal)",
    )


def build_parser(prog: str = "encore") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Encore command-line client (HTTP API)")
    parser.set_defaults(prog=prog)  # how the user calls it, for the hints printed later
    add_connection_options(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    add_connection_options(common, suppress=True)

    submit = commands.add_parser("submit", help="submit a job").add_subparsers(
        dest="kind", required=True, metavar="KIND"
    )
    music = submit.add_parser("music", parents=[common], help="generate music")
    music.add_argument("--mode", choices=["vocal", "instrumental"])
    music.add_argument("--tags", help="comma-separated style tags")
    music.add_argument("--prompt", help="a description of the music")
    lyrics = music.add_mutually_exclusive_group()
    lyrics.add_argument("--lyrics-file", type=Path, help="lyrics text file ([verse]/[chorus] sections)")
    lyrics.add_argument("--lyrics", help="lyrics as a string")
    music.add_argument("--duration-s", type=float)
    music.add_argument("--tracks", type=int, help="number of tracks (num_tracks)")
    music.add_argument("--seed", type=int)
    music.add_argument("--temperature", type=float)
    music.add_argument("--top-k", type=int)
    add_priority_option(music)
    add_wait_options(music)
    music.set_defaults(handler=cmd_submit_music)

    lipsync = submit.add_parser("lipsync", parents=[common], help="lip-sync a face video to an audio track")
    lipsync.add_argument("video", type=Path)
    lipsync.add_argument("audio", type=Path)
    lipsync.add_argument("--fps", type=float, help="output frame rate (default: the source video's)")
    lipsync.add_argument("--extra-margin", type=int, help="pixels added below the face box")
    lipsync.add_argument("--batch-size", type=int, help="frames per UNet batch")
    add_priority_option(lipsync)
    add_wait_options(lipsync)
    lipsync.set_defaults(handler=cmd_submit_lipsync)

    wait = commands.add_parser("wait", parents=[common], help="follow a submitted job and download its results")
    wait.add_argument("job_id")
    add_wait_options(wait, with_flag=False)
    wait.set_defaults(handler=cmd_wait)

    cancel = commands.add_parser("cancel", parents=[common], help="cancel a job")
    cancel.add_argument("job_id")
    cancel.add_argument("--wait", action="store_true", help="wait until every track has ended")
    cancel.add_argument("--interval", type=float, default=0.25)
    cancel.add_argument("--poll", action="store_true", help="poll instead of following the job's events")
    cancel.set_defaults(handler=cmd_cancel)

    retry = commands.add_parser("retry", parents=[common], help="re-run a job's failed or canceled tracks")
    retry.add_argument("job_id")
    add_wait_options(retry)
    retry.set_defaults(handler=cmd_retry)

    status = commands.add_parser("status", parents=[common], help="workers and queues")
    status.add_argument("--json", action="store_true", help="print the raw status JSON")
    status.set_defaults(handler=cmd_status)

    jobs = commands.add_parser("jobs", parents=[common], help="recent jobs")
    jobs.add_argument("--limit", type=int, default=20)
    jobs.add_argument("--json", action="store_true", help="print the raw job records")
    jobs.set_defaults(handler=cmd_jobs)

    drain = commands.add_parser(
        "drain", parents=[common], help="stop routing to a queue and move its waiting tracks elsewhere"
    )
    drain.add_argument("queue", help="e.g. gpu0")
    drain.set_defaults(handler=cmd_drain)
    resume = commands.add_parser("resume", parents=[common], help="route to a drained queue again")
    resume.add_argument("queue", help="e.g. gpu0")
    resume.set_defaults(handler=cmd_resume)
    hash_token = commands.add_parser(
        "hash-token",
        parents=[common],
        help="print the SHA-256 digest of a token read from standard input, for ENCORE_TENANTS_FILE",
    )
    hash_token.set_defaults(handler=cmd_hash_token)
    events = commands.add_parser(
        "events",
        help="run the events server: jobs' event streams on one asyncio loop (ENCORE_EVENTS_BIND, :8001)",
    )
    events.add_argument("--bind", help="host:port (default: ENCORE_EVENTS_BIND)")
    events.set_defaults(handler=cmd_events)
    return parser


def cmd_events(client: Client, args: argparse.Namespace) -> int:
    """The events server (app/http/events_server.py), imported here only: the client stays light."""
    from app.http.events_server import main as serve_events

    return serve_events(args.bind)


def cmd_hash_token(client: Client, args: argparse.Namespace) -> int:
    """The digest a tenants file stores for a token (app/core/tenants.py). The token is read from standard input,
    never from the command line, where shell history and `ps` would keep it."""
    token = sys.stdin.readline().strip()
    if not token or any(c.isspace() for c in token):
        raise UsageError("give the token on standard input: one line, no white space inside")
    print(token_digest(token))
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "encore") -> int:
    """The `encore` command (pyproject.toml's [project.scripts]); `python -m app` passes its own name."""
    args = build_parser(prog).parse_args(argv)
    client = Client(args.url, args.token)
    handler: Callable[[Client, argparse.Namespace], int] = args.handler
    try:
        return handler(client, args)
    except (ApiError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
