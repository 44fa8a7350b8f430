"""Songs and videos per GPU-hour under an offered load, through real workers in the README's one-host shape.

N music jobs and M lip-sync jobs are submitted at once over the HTTP API (the Flask app in this process, Redis and
one real prefork worker per "GPU" started by worker_entrypoint.sh, as the README deploys them); the bench waits
for every job to end and reads what happened from the job records (each stage's start, end and worker). Printed
as one JSON object:

  songs_per_hour, videos_per_hour      jobs done / makespan (submission of the first to the end of the last)
  tracks_per_hour                      music tracks done / makespan
  backbone_tracks_per_hour             backbone stages finished / the wall time the worker spent in backbone
                                       (the union of its backbone intervals, a batched pass counted once, less
                                       the time the engine ran other stages between its blocks)
  job_latency_s p50 / p95              submission to the job's last stage's end, per kind
  gpu_stage_occupancy                  the share of the wall time, from the first submission until the last GPU
                                       stage ends (GPU work waits all along under this load), that the worker
                                       spends in GPU stages (backbone, superres, decode, lipsync) and not in
                                       CPU stages (export, prepare, mux) or idle: the union of the GPU stages'
                                       intervals less the time CPU stages ran in the same child
  stage_seconds                        total seconds per stage, to see where the time goes
  cpu_worker_stage_runs                stages the CPU-stage worker ran (0 in `today`)
  gpu_child_busy_s                     seconds the GPU worker's child ran any stage (the union of its stages'
                                       intervals): over the jobs, a mode's service time per job, so that an
                                       arrival rate's load on it is rate x busy / jobs
  engine                               the engine's tally over the measured jobs (app/tasks/engine.py EngineTally):
                                       runs, blocks, frames, block seconds, the slots' mean fill, ms per frame,
                                       seconds at boundaries (admitting) and running listed stages
  eta_error                            per kind, |latency - eta_s at submission| / latency: p50 and p90 (how
                                       true the first ETA a client reads is)

`--scenario fairness` (per mode): tenant B's song alone, then tenant A's `--music` songs at once and B's song
once A's fill the GPU: B's latency amid A's backlog over its latency alone (the target is <= 2), how long B's
backbone waited from its submission (`b_backbone_wait_s`: under the engine, one block or so: a track of A's is
paused for it), whether it started before any slot freed (`b_started_before_a_slot_freed`: A's songs hold every
slot when B comes; without pausing B would wait for one of them to end), how many of A's songs ended their
backbone before B's began, and B's queue_position at submission.

Modes, side by side in one run (each its own Redis and workers, one after the other):
  today           the worker as it ran before issue 35: no engine (ENCORE_BACKBONE_SLOTS=1: one song's tracks per
                  backbone pass, every stage a delivery of its own) and no CPU-stage worker (ENCORE_WORKER_ROLE=gpu:
                  export, prepare and mux in the GPU child)
  engine          the in-flight backbone engine (its default slot cap, 16: app/pipeline/music/options.py; exact
                  per-track products) and the CPU-stage worker beside
                  the GPU worker, as worker_entrypoint.sh starts them (app/tasks/engine.py, app/core/queues.py)
  engine-batched  the same with ENCORE_ENGINE_MATMUL=batched (one product over 16-row tiles for the slots in use)
The default runs `today,engine`.
`--profile shaped` runs the music models of the `shaped` profile (app/pipeline/profiles.py: random weights, a
backbone big enough that a track's stage times split as an H200's do at Khala sizes, ~87/10/3 % here
(bench/stage_shares.py; the shares depend on the CPU)), written to models/shaped on first use; `tiny` (the default)
has the backbone at ~50 %, which misjudges a scheduler. The lip-sync models follow `--profile` unless
`--lipsync-profile` names others: `shaped` is the tiny MuseTalk with one attention head in its UNet
(app/pipeline/lipsync/musetalk.py SHAPED_UNET), so that a video weighs beside a song about what it weighs on an H200
(bench/stage_shares.py's `lipsync` line), written to models/lipsync-shaped on first use.
`--tiny` (3 songs, 1 video, short lengths, the tiny models) runs in the test suite; its numbers are noise.

    python bench/throughput.py [--tiny] [--profile tiny|shaped] [--lipsync-profile tiny|shaped] [--music 16]
                               [--lipsync 4] [--song-s 10] [--clip-s 2] [--modes today,engine]
                               [--arrivals burst|poisson --per-hour N --seed 1] [--scenario throughput|fairness]
                               [--records DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from app.pipeline.music.options import DEFAULT_SLOT_CAP  # noqa: E402
from bench.common import machine_facts, start_redis  # noqa: E402

GPU_STAGES = frozenset({"backbone", "superres", "decode", "lipsync"})
ENDED = ("done", "failed", "canceled", "partial")
MODES = ("today", "engine", "engine-batched")
DEFAULT_MODES = ("today", "engine")
MODE_ENV = {  # every mode names every variable: one mode's must not leak into the next (the web reads os.environ)
    "today": {"ENCORE_BACKBONE_SLOTS": "1", "ENCORE_WORKER_ROLE": "gpu", "ENCORE_ENGINE_MATMUL": "exact"},
    "engine": {
        "ENCORE_BACKBONE_SLOTS": str(DEFAULT_SLOT_CAP),
        "ENCORE_WORKER_ROLE": "both",
        "ENCORE_ENGINE_MATMUL": "exact",
    },
    "engine-batched": {
        "ENCORE_BACKBONE_SLOTS": str(DEFAULT_SLOT_CAP),
        "ENCORE_WORKER_ROLE": "both",
        "ENCORE_ENGINE_MATMUL": "batched",
    },
}


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end] intervals as disjoint intervals, in order."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of [start, end] intervals (a batched pass's shared interval counts once)."""
    return sum(end - start for start, end in union(intervals))


def covered_less(intervals: list[tuple[float, float]], removed: list[tuple[float, float]]) -> float:
    """Seconds covered by `intervals` and not by `removed`."""
    overlap = 0.0
    for start, end in union(intervals):
        for cut_start, cut_end in union(removed):
            overlap += max(0.0, min(end, cut_end) - max(start, cut_start))
    return union_seconds(intervals) - overlap


def stage_runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every finished stage of every track: kind, stage, worker, start, end."""
    runs = []
    for record in records:
        for track in record["tracks"]:
            for name, stage in (track.get("stages") or {}).items():
                if stage.get("started_at") is not None and stage.get("finished_at") is not None:
                    runs.append(
                        {
                            "kind": record["kind"],
                            "stage": name,
                            "worker": stage.get("worker", ""),
                            "start": float(stage["started_at"]),
                            "end": float(stage["finished_at"]),
                        }
                    )
    return runs


def percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))], 2)


def eta_errors(
    records: list[dict[str, Any]], submitted_at: dict[str, float], eta_at_submit: dict[str, float | None]
) -> dict[str, dict[str, float | None]]:
    """Per kind, p50 and p90 of |latency - eta_s at submission| / latency over the jobs done."""
    errors: dict[str, list[float]] = {"music": [], "lipsync": []}
    for record in records:
        predicted = eta_at_submit.get(record["job_id"])
        if record["state"] != "done" or predicted is None:
            continue
        latency = max(run["end"] for run in stage_runs([record])) - submitted_at[record["job_id"]]
        errors[record["kind"]].append(abs(latency - predicted) / max(latency, 1e-9))
    return {kind: {"p50": percentile(v, 0.5), "p90": percentile(v, 0.9)} for kind, v in errors.items()}


def summarize(records: list[dict[str, Any]], submitted_at: dict[str, float]) -> dict[str, Any]:
    """The figures above, from the ended jobs' records and when each was submitted."""
    runs = stage_runs(records)
    first = min(submitted_at.values())
    last = max((run["end"] for run in runs), default=first)
    makespan = max(last - first, 1e-9)
    done = [r for r in records if r["state"] == "done"]
    music = [r for r in done if r["kind"] == "music"]
    videos = [r for r in done if r["kind"] == "lipsync"]
    latency: dict[str, list[float]] = {"music": [], "lipsync": []}
    for record in done:
        ends = [run["end"] for run in stage_runs([record])]
        latency[record["kind"]].append(max(ends) - submitted_at[record["job_id"]])
    gpu_runs = [(run["start"], run["end"]) for run in runs if run["stage"] in GPU_STAGES]
    cpu_runs = [  # CPU stages that ran in the GPU worker's child (not those of the CPU-stage worker beside it)
        (run["start"], run["end"])
        for run in runs
        if run["stage"] not in GPU_STAGES and not run["worker"].startswith("cpu")
    ]
    gpu_window = max((end for _, end in gpu_runs), default=first) - first
    backbone = [(run["start"], run["end"]) for run in runs if run["stage"] == "backbone"]
    others = [  # what the GPU child ran between the engine's blocks
        (run["start"], run["end"]) for run in runs if run["stage"] != "backbone" and not run["worker"].startswith("cpu")
    ]
    stage_seconds: dict[str, float] = {}
    for run in runs:
        stage_seconds[run["stage"]] = round(stage_seconds.get(run["stage"], 0.0) + run["end"] - run["start"], 2)
    return {
        "jobs": len(records),
        "jobs_done": len(done),
        "makespan_s": round(makespan, 2),
        "songs_per_hour": round(len(music) * 3600 / makespan, 1),
        "videos_per_hour": round(len(videos) * 3600 / makespan, 1),
        "tracks_per_hour": round(sum(len(r["tracks"]) for r in music) * 3600 / makespan, 1),
        "backbone_tracks_per_hour": round(len(backbone) * 3600 / max(covered_less(backbone, others), 1e-9), 1)
        if backbone
        else None,
        "job_latency_s": {
            kind: {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95)} for kind, values in latency.items()
        },
        "gpu_stage_occupancy": round(covered_less(gpu_runs, cpu_runs) / gpu_window, 3) if gpu_window > 0 else None,
        "stage_seconds": stage_seconds,
        "cpu_worker_stage_runs": sum(1 for run in runs if run["worker"].startswith("cpu")),
        "gpu_child_busy_s": round(
            union_seconds([(run["start"], run["end"]) for run in runs if not run["worker"].startswith("cpu")]), 2
        ),
    }


def engine_tally(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """The GPU worker's engine tally (app/tasks/engine.py EngineTally: the `engine_*` totals of its heartbeat hash)
    over the measured jobs: `after` less `before`, with the slots' mean fill over the blocks' time; None without
    an engine."""
    if "engine_blocks" not in after:
        return None
    totals = [key for key in after if key.startswith("engine_") and key != "engine_slots"]  # engine_slots: a count
    tally = {key[len("engine_") :]: round(float(after[key]) - float(before.get(key, 0)), 3) for key in totals}
    slots = int(after["engine_slots"])
    tally["slot_fill"] = round(tally["slot_s"] / (slots * tally["block_s"]), 3) if slots and tally["block_s"] else 0.0
    tally["ms_per_frame"] = round(1000 * tally["block_s"] / tally["frames"], 2) if tally["frames"] else 0.0
    tally["rows_per_frame"] = round(tally["rows"] / tally["frames"], 1) if tally["frames"] else 0.0
    return tally


class Deployment:
    """Redis, the web app (in this process) and one worker, as the README's one-host shape runs them."""

    def __init__(self, root: Path, mode_env: dict[str, str], profile: str = "tiny", lipsync_profile: str = "tiny"):
        self.root = root
        self.redis, url = start_redis(root)
        self.env = {
            "REDIS_URL": url,
            "ENCORE_MUSIC_PROFILE": profile,
            "ENCORE_MODEL_DIR": str(music_models(profile)),
            "ENCORE_LIPSYNC_PROFILE": lipsync_profile,
            "ENCORE_LIPSYNC_MODEL_DIR": str(lipsync_models(lipsync_profile)),
            "ENCORE_ARTIFACT_DIR": str(root / "artifacts"),
            "ENCORE_UPLOAD_DIR": str(root / "uploads"),
            "ENCORE_LOG_DIR": str(root / "logs"),
            "ENCORE_WORKER_CACHE_DIR": str(root / "cache"),
            "ENCORE_HEARTBEAT_S": "0.5",
            "ENCORE_PYTHON": sys.executable,
            "ENCORE_PRELOAD": "1",
            "ENCORE_SONG_END": "duration",
            "ENCORE_SUBMIT_RATE_LIMIT": "off",
            "ENCORE_MIN_VIDEO_S": "1",
            # the "GPU" is one core in every mode: on a GPU host the model runs on the device, not on the cores
            # the CPU-stage worker uses; two torch threads on a 2-core machine would fight its ffmpeg instead
            "ENCORE_TORCH_THREADS": "1",
            "API_TOKEN": ",".join(TENANT_TOKENS.values()),  # a tenant per token (fairness); polls as the admin
            "ENCORE_ADMIN_TOKENS": ADMIN_TOKEN,
            **mode_env,
        }
        self.eta_at_submit: dict[str, float | None] = {}
        self.position_at_submit: dict[str, int] = {}
        os.environ.update(self.env)
        from app.core.config import load_settings
        from app.web import create_app

        self.client = create_app(load_settings()).test_client()
        self.worker = subprocess.Popen(
            ["bash", str(REPO / "worker_entrypoint.sh"), "0"],
            cwd=REPO,
            env={**os.environ, **self.env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_for_worker(self, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        wanted = ("gpu", "cpu") if self.env.get("ENCORE_WORKER_ROLE") == "both" else ("gpu",)

        def up() -> bool:
            idle = [w["name"] for w in self.get("/api/v1/status")["workers"] if w.get("status") == "idle"]
            return all(any(name.startswith(role) for name in idle) for role in wanted)

        while not up():
            if time.monotonic() > deadline or self.worker.poll() is not None:
                log = self.root / "logs" / "worker_0.log"
                raise SystemExit("worker did not come up: " + (log.read_text()[-2000:] if log.exists() else ""))
            time.sleep(0.2)

    def gpu_worker(self) -> dict[str, Any]:
        """The GPU worker's heartbeat hash, read from Redis (its engine tally among its fields)."""
        from app.control.services import build_services
        from app.core.config import load_settings

        workers = build_services(load_settings()).workers.workers()
        return next((w for w in workers if w["name"].startswith("gpu") and w["status"] != "offline"), {})

    def get(self, path: str) -> dict[str, Any]:
        return self.client.get(path, headers=_bearer(ADMIN_TOKEN)).get_json()

    def _accepted(self, kind: str, reply: Any) -> str:
        if reply.status_code != 202:
            raise SystemExit(f"{kind} submit answered {reply.status_code}: {reply.get_json()}")
        body = reply.get_json()
        self.eta_at_submit[body["job_id"]] = body.get("eta_s")
        self.position_at_submit[body["job_id"]] = body.get("queue_position") or 0
        return body["job_id"]

    def submit_music(self, song_s: float, seed: int, tenant: str = "a") -> str:
        body = {"mode": "instrumental", "tags": "ambient", "duration_s": song_s, "num_tracks": 2, "seed": seed}
        headers = _bearer(TENANT_TOKENS[tenant])
        return self._accepted("music", self.client.post("/api/v1/music", json=body, headers=headers))

    def submit_lipsync(self, video: Path, audio: Path) -> str:
        with open(video, "rb") as v, open(audio, "rb") as a:
            reply = self.client.post(
                "/api/v1/lipsync",
                data={"video": (v, "face.mp4"), "audio": (a, "voice.wav")},
                content_type="multipart/form-data",
                headers=_bearer(TENANT_TOKENS["a"]),
            )
        return self._accepted("lipsync", reply)

    def wait_all(self, job_ids: list[str], limit_s: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + limit_s
        pending, records = set(job_ids), {}
        while pending and time.monotonic() < deadline:
            for job_id in list(pending):
                record = self.get(f"/api/v1/jobs/{job_id}")
                if record["state"] in ENDED:
                    records[job_id] = record
                    pending.discard(job_id)
            time.sleep(0.2)
        if pending:
            raise SystemExit(f"{len(pending)} jobs had not ended after {limit_s} s")
        return [records[job_id] for job_id in job_ids]

    def close(self) -> None:
        os.killpg(self.worker.pid, 9)
        self.redis.terminate()


TENANT_TOKENS = {"a": "bench-tenant-a", "b": "bench-tenant-b"}
ADMIN_TOKEN = "bench-admin"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def music_models(profile: str) -> Path:
    """The random-weight models of `profile` (written on first use; setup.sh writes the tiny ones)."""
    from app.pipeline.tiny import write_tiny_models

    return write_tiny_models(REPO / "models" / profile, profile_name=profile)


def lipsync_models(profile: str) -> Path:
    """The random-weight MuseTalk models of lip-sync profile `profile` (written on first use; setup.sh writes the
    tiny ones)."""
    from app.pipeline.tiny import write_tiny_lipsync_models

    return write_tiny_lipsync_models(REPO / "models" / f"lipsync-{profile}", profile_name=profile)


def media(root: Path, clip_s: float) -> tuple[Path, Path]:
    """A face clip and a driving voice of `clip_s` seconds (the GPU lip-sync bench's own synthetic inputs)."""
    from bench.gpu_lipsync import write_clip, write_voice

    return write_clip(root / "face.mp4", clip_s), write_voice(root / "voice.wav", clip_s)


def schedule(args: argparse.Namespace) -> list[tuple[tuple[str, int], float]]:
    """When each job is offered, in seconds from the start: music and lip-sync interleaved; all at once
    (`--arrivals burst`), or a Poisson process of `--per-hour` jobs an hour (seeded: every mode gets the same
    schedule)."""
    jobs = [
        (kind, index)
        for index in range(max(args.music, args.lipsync))
        for kind, count in (("music", args.music), ("lipsync", args.lipsync))
        if index < count
    ]
    if args.arrivals == "burst":
        return [(job, 0.0) for job in jobs]
    rng = random.Random(args.seed)
    offsets, clock = [], 0.0
    for job in jobs:
        offsets.append((job, clock))
        clock += rng.expovariate(args.per_hour / 3600.0)
    return offsets


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"encore-throughput-{mode}-"))
    deployment = Deployment(root, MODE_ENV[mode], args.profile, args.lipsync_profile)
    try:
        deployment.wait_for_worker(180)
        video, audio = media(root, args.clip_s)
        warm = [deployment.submit_music(1.0, 0)] + ([deployment.submit_lipsync(video, audio)] if args.lipsync else [])
        deployment.wait_all(warm, args.limit_s)  # models loaded, kernels warm: not counted
        tally_before = deployment.gpu_worker()
        submitted: dict[str, float] = {}
        start = time.monotonic()
        for (kind, index), offset in schedule(args):
            time.sleep(max(0.0, start + offset - time.monotonic()))  # an arrival schedule, not a wait for state
            job_id = deployment.submit_music(args.song_s, 100 + index) if kind == "music" else None
            submitted[job_id or deployment.submit_lipsync(video, audio)] = time.time()
        records = deployment.wait_all(list(submitted), args.limit_s)
        if args.records:  # every job's record and submission time, for a look at the timeline
            Path(args.records).mkdir(parents=True, exist_ok=True)
            dump = {"submitted": submitted, "eta_at_submit": deployment.eta_at_submit, "records": records}
            (Path(args.records) / f"{mode}.json").write_text(json.dumps(dump))
        errors = eta_errors(records, submitted, deployment.eta_at_submit)
        engine = engine_tally(tally_before, deployment.gpu_worker())
        return {"mode": mode, **summarize(records, submitted), "eta_error": errors, "engine": engine}
    finally:
        deployment.close()


def _backbone_ends(record: dict[str, Any]) -> list[float]:
    return [float(t["stages"]["backbone"]["finished_at"]) for t in record["tracks"] if "backbone" in t["stages"]]


def run_fairness(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Tenant B's song alone, then amid tenant A's backlog of `--music` songs (see the module doc)."""
    root = Path(tempfile.mkdtemp(prefix=f"encore-fairness-{mode}-"))
    deployment = Deployment(root, MODE_ENV[mode], args.profile, args.lipsync_profile)
    try:
        deployment.wait_for_worker(180)
        deployment.wait_all([deployment.submit_music(1.0, 0)], args.limit_s)  # models loaded: not counted
        alone_at = time.time()
        alone = deployment.wait_all([deployment.submit_music(args.song_s, 7, tenant="b")], args.limit_s)[0]
        alone_latency = max(run["end"] for run in stage_runs([alone])) - alone_at
        backlog = [deployment.submit_music(args.song_s, 100 + index, tenant="a") for index in range(args.music)]
        deadline = time.monotonic() + args.limit_s
        while not any(  # A's songs hold the GPU (its first one's backbone started): B comes while A's backlog waits
            "backbone" in t["stages"] for t in deployment.get(f"/api/v1/jobs/{backlog[0]}")["tracks"]
        ):
            if time.monotonic() > deadline:
                raise SystemExit("tenant A's first song never started")
            time.sleep(0.05)
        offered = time.time()
        newcomer = deployment.submit_music(args.song_s, 7, tenant="b")
        record = deployment.wait_all([newcomer], args.limit_s)[0]
        latency = max(run["end"] for run in stage_runs([record])) - offered
        started = min(float(t["stages"]["backbone"]["started_at"]) for t in record["tracks"])
        a_records = deployment.wait_all(backlog, args.limit_s)
        freed = [end for r in a_records for end in _backbone_ends(r) if end > offered]
        first_free = min(freed, default=offered)
        return {
            "mode": mode,
            "a_songs": args.music,
            "b_latency_alone_s": round(alone_latency, 2),
            "b_latency_amid_s": round(latency, 2),
            "b_latency_ratio": round(latency / max(alone_latency, 1e-9), 2),
            "b_queue_position_at_submit": deployment.position_at_submit[newcomer],
            "b_backbone_wait_s": round(max(0.0, started - offered), 2),
            # A's songs hold every slot when B comes: without pausing one of A's tracks, B waits for one to end
            "b_started_before_a_slot_freed": started < first_free,
            "a_songs_done_before_b_started": sum(
                1 for r in a_records if r["state"] == "done" and max(_backbone_ends(r), default=0) < started
            ),
        }
    finally:
        deployment.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="3 songs, 1 video, short lengths (the suite's smoke run)")
    parser.add_argument("--profile", default="tiny", choices=("tiny", "shaped"), help="the music models")
    parser.add_argument(
        "--lipsync-profile", default=None, choices=("tiny", "shaped"), help="the lip-sync models (default: --profile's)"
    )
    parser.add_argument("--music", type=int, default=16, help="concurrent music jobs (2 tracks each)")
    parser.add_argument("--lipsync", type=int, default=4, help="concurrent lip-sync jobs")
    parser.add_argument("--song-s", type=float, default=10.0)
    parser.add_argument("--clip-s", type=float, default=2.0)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {MODES}")
    parser.add_argument("--arrivals", default="burst", choices=("burst", "poisson"), help="all at once, or spread")
    parser.add_argument(
        "--per-hour", type=float, default=0.0, help="poisson: jobs offered per hour (e.g. 0.8x today's)"
    )
    parser.add_argument("--seed", type=int, default=1, help="poisson: the arrival schedule's seed")
    parser.add_argument("--limit-s", type=float, default=1800.0, help="give up when the jobs have not ended by then")
    parser.add_argument("--records", default="", help="a folder to write each mode's job records to (JSON)")
    parser.add_argument("--scenario", default="throughput", choices=("throughput", "fairness"), help="module doc")
    args = parser.parse_args()
    if args.tiny:
        args.music, args.lipsync, args.song_s, args.clip_s = min(args.music, 3), min(args.lipsync, 1), 2.0, 1.2
    args.lipsync_profile = args.lipsync_profile or args.profile
    if args.arrivals == "poisson" and args.per_hour <= 0:
        parser.error("--arrivals poisson needs --per-hour > 0")
    modes = [mode for mode in args.modes.split(",") if mode]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; built: {list(MODES)}")
    music_models(args.profile)  # before any worker starts: a Megatron save must not race a worker's load
    lipsync_models(args.lipsync_profile)
    started = time.time()
    run = run_fairness if args.scenario == "fairness" else run_mode
    results = [run(mode, args) for mode in modes]
    print(
        json.dumps(
            {
                "benchmark": "throughput" if args.scenario == "throughput" else "fairness",
                "profile": args.profile,
                "lipsync_profile": args.lipsync_profile,
                "music_jobs": args.music,
                "lipsync_jobs": args.lipsync,
                "song_s": args.song_s,
                "clip_s": args.clip_s,
                "arrivals": args.arrivals,
                **({"per_hour": args.per_hour, "seed": args.seed} if args.arrivals == "poisson" else {}),
                "machine": machine_facts(),
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "wall_s": round(time.time() - started, 1),
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
