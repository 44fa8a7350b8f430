"""Command-line client for Encore's HTTP API: submit, follow, download, cancel, inspect.

    encore submit music --tags "lo-fi, piano" --mode instrumental --duration-s 10 --wait
    encore submit lipsync face.mp4 speech.wav --fps 25 --wait --out out/synced
    encore status | jobs | wait ID | cancel ID

`encore` is the command pyproject.toml installs (scripts/setup.sh installs the project into .venv); `python -m app`
is the same client where the `app` package is importable (the project's folder, or any folder once installed).

This module is the argument parsing and the commands; the pieces they use live by concern beside it: the HTTP
client and the event-stream format (http_client.py), following a job (following.py), the progress display
(reporters.py) and saving results (downloads.py). `events` runs a server, not a client: its entry is the HTTP
layer's (app/http/events_server.py, reached through app/__main__.py), and this module never imports it.

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
from pathlib import Path
from typing import Any, BinaryIO, Callable, Sequence

from app.clients.downloads import download_results
from app.clients.following import fetch_record, follow
from app.clients.http_client import ApiError, Client, ClientSettings
from app.clients.reporters import LineReporter, describe, make_reporter
from app.core.config import DEFAULT_WEB_URL
from app.core.kinds import QUEUED
from app.core.priority import PRIORITIES
from app.core.tenants import token_digest

EXIT_OK, EXIT_JOB_NOT_DONE, EXIT_ERROR = 0, 1, 2


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
        add_help=False,  # its --help and --bind are the server's own (app/http/events_server.py)
        help="run the events server: jobs' event streams on one asyncio loop (ENCORE_EVENTS_BIND, :8001)",
    )
    events.set_defaults(handler=cmd_events)
    return parser


def cmd_events(client: Client, args: argparse.Namespace) -> int:
    """`encore events [--bind host:port]`: this process becomes `python -m app events` with the same arguments,
    whose entry is the HTTP layer's (app/__main__.py hands `events` to app/http/events_server.py). The client
    never imports server code (aiohttp, Redis): it hands the command over, under the same process id."""
    os.execv(sys.executable, [sys.executable, "-m", "app", "events", *args.server_args])


def cmd_hash_token(client: Client, args: argparse.Namespace) -> int:
    """The digest a tenants file stores for a token (app/core/tenants.py). The token is read from standard input,
    never from the command line, where shell history and `ps` would keep it. A client command, unlike `events`: it
    starts nothing and needs nothing of the server (the digest is core's, standard library only), so it runs
    wherever `encore` is installed, and whoever holds a token can hash it there."""
    token = sys.stdin.readline().strip()
    if not token or any(c.isspace() for c in token):
        raise UsageError("give the token on standard input: one line, no white space inside")
    print(token_digest(token))
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "encore") -> int:
    """The `encore` command (pyproject.toml's [project.scripts]); `python -m app` passes its own name. Arguments
    no command knows are an error, as argparse makes them, except after `events`: those are the server's."""
    parser = build_parser(prog)
    args, server_args = parser.parse_known_args(argv)
    if server_args and args.command != "events":
        parser.error(f"unrecognized arguments: {' '.join(server_args)}")
    args.server_args = server_args
    client = Client(args.url, args.token)
    handler: Callable[[Client, argparse.Namespace], int] = args.handler
    try:
        return handler(client, args)
    except (ApiError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
