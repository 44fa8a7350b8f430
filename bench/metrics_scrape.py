"""Cost of the gauges that look at every job (GET /metrics, Khala's GET /status) with many jobs in Redis.

Baseline, in the same run: reading each job's record the way a single-job request does (the job hash, then
each track hash: 1 + tracks round trips per job), which is what the gauges did before they used
JobStore.track_states (two pipelined round trips per 500 jobs). Then a whole /metrics scrape and a Khala
/status through the Flask app. Prints JSON.

    python bench/metrics_scrape.py [--jobs 5000] [--tracks 2]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import start_redis  # noqa: E402


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--tracks", type=int, default=2)
    args = parser.parse_args()
    from app.config import Settings
    from app.services import build_services
    from app.web import create_app

    with tempfile.TemporaryDirectory() as scratch:
        server, url = start_redis(Path(scratch))
        try:
            settings = Settings(redis_url=url, artifact_dir=Path(scratch) / "artifacts")
            svc = build_services(settings)
            for index in range(args.jobs):
                job_id = svc.jobs.create("music", {}, [{"seed": i} for i in range(args.tracks)], cost=1.0)
                if index % 3 == 0:
                    svc.jobs.finish(job_id, 0, "done")
            ids = svc.jobs.recent_job_ids(limit=args.jobs)

            def per_record() -> None:
                for job_id in ids:
                    job = svc.jobs.job(job_id)
                    [t["state"] for t in svc.jobs.tracks(job_id, job["num_tracks"])]

            baseline = timed(per_record)
            pipelined = timed(lambda: svc.jobs.track_states(ids))
            client = create_app(settings).test_client()
            scrape = timed(lambda: client.get("/metrics"))
            status = timed(lambda: client.get("/status"))
            print(json.dumps({
                "jobs": args.jobs, "tracks_per_job": args.tracks,
                "per_record_reads_s": round(baseline, 3), "track_states_s": round(pipelined, 3),
                "speedup": round(baseline / pipelined, 1),
                "metrics_scrape_s": round(scrape, 3), "khala_status_s": round(status, 3),
            }))
        finally:
            server.terminate()
            server.wait(10)


if __name__ == "__main__":
    main()
