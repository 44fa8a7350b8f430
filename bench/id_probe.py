"""Can another tenant tell which job ids exist by timing the routes that name one? For each such route, the time
and the Redis commands of a request for another tenant's real job id against those for an unknown id, both
answered 404, in interleaved pairs (the unknown id is the baseline of the same run).

The web is Encore's Flask application in this process (Flask's test client: no network between, so what differs
is the server's own work), over a private redis-server; tenant `acme` owns a job (parked: no worker), tenant
`beta` asks. Prints JSON (and writes it to --out): per route, the median time of each kind of request, their
median paired difference (real minus unknown) and the Redis commands each ran (from INFO commandstats).

    python bench/id_probe.py [--pairs 1000] [--out bench/results/id_probe.json]
    python bench/id_probe.py --tiny        # a smoke run (50 pairs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import start_redis
from harness.processes import redis_work

ROUTES = [
    "/api/v1/jobs/{id}",
    "/api/v1/jobs/{id}/tracks/0.mp3",
    "/api/v1/jobs/{id}/video.mp4",
    "/job/{id}",
    "/job/{id}/track/0/mp3",
]
UNKNOWN = "f" * 32
TOKENS = {"acme-token": "acme", "beta-token": "beta"}


def probe(web: Any, redis_client: Any, path: str, headers: dict[str, str]) -> tuple[float, dict[str, int]]:
    """One request's time (seconds) and the Redis commands it ran; it must be answered 404."""

    def timed() -> tuple[Any, float]:
        started = time.perf_counter()
        reply = web.get(path, headers=headers)
        return reply, time.perf_counter() - started

    (reply, took), ran = redis_work(redis_client, timed)
    assert reply.status_code == 404, (path, reply.status_code)
    return took, ran


def measure(pairs: int) -> dict[str, Any]:
    from app.core.config import Settings
    from app.core.tenants import CLIENT, token_digest
    from app.web import create_app

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        server, url = start_redis(root)
        try:
            tenants = {name: {"role": CLIENT, "token_sha256": [token_digest(t)]} for t, name in TOKENS.items()}
            (root / "tenants.json").write_text(json.dumps({"tenants": tenants}))
            settings = Settings(redis_url=url, tenants_file=root / "tenants.json")
            web = create_app(settings).test_client()
            body = {"mode": "instrumental", "tags": "x", "duration_s": 2.0, "num_tracks": 1}
            created = web.post("/api/v1/music", json=body, headers={"Authorization": "Bearer acme-token"})
            assert created.status_code == 202, created.get_json()
            real = created.get_json()["job_id"]
            import redis

            redis_client = redis.Redis.from_url(url)
            asker = {"Authorization": "Bearer beta-token"}
            results = {}
            for route in ROUTES:
                times: dict[str, list[float]] = {"real": [], "unknown": []}
                work: dict[str, dict[str, int]] = {}
                for index in range(pairs):
                    order = [("real", real), ("unknown", UNKNOWN)]
                    for kind, job_id in order if index % 2 else order[::-1]:  # interleaved, each first half the time
                        took, ran = probe(web, redis_client, route.format(id=job_id), asker)
                        times[kind].append(took)
                        work[kind] = ran
                differences = [a - b for a, b in zip(times["real"], times["unknown"], strict=True)]
                results[route] = {
                    "real_ms": round(statistics.median(times["real"]) * 1000, 4),
                    "unknown_ms": round(statistics.median(times["unknown"]) * 1000, 4),
                    "median_difference_ms": round(statistics.median(differences) * 1000, 4),
                    "redis_commands_real": work["real"],
                    "redis_commands_unknown": work["unknown"],
                    "same_redis_work": work["real"] == work["unknown"],
                }
            return {"pairs": pairs, "routes": results}
        finally:
            server.terminate()
            server.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 50 pairs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    figures = measure(50 if args.tiny else args.pairs)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
