"""Reading a RedisStore file into the local cache: milliseconds per MiB with READ_BATCH_CHUNKS-style batches
(one LRANGE of B chunks per round trip) against the old read (EXISTS, LLEN, then one LINDEX per 1 MiB chunk)
as the baseline, interleaved in the same run against a private redis-server on loopback. A batch saves
(1 - 1/B) round trips per MiB and costs client time per MiB; `break_even_rtt_ms` is the round-trip time above
which batch B beats batch 1, the same read one chunk per round trip (from the loopback figures). Prints JSON.

    python bench/artifact_reads.py [--mib 32] [--rounds 20] [--batches 1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from app.adapters.artifacts import CHUNK_BYTES, READ_BATCH_CHUNKS, RedisStore  # noqa: E402
from bench.common import start_redis  # noqa: E402

JOB = "ab" * 16


def chunk_per_round_trip(client: redis.Redis, key: str, target: Path) -> None:
    """The read before batching, kept here as the baseline (into a new file, as the store writes one)."""
    target.unlink(missing_ok=True)
    assert client.exists(key)
    with open(target, "wb") as handle:
        for index in range(client.llen(key)):
            handle.write(client.lindex(key, index))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batches", default="1,2,4,8", help="batch sizes to run; 1 must be among them")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="artifact-reads-"))
    proc, url = start_redis(root)
    try:
        client = redis.Redis.from_url(url)
        source = root / "file.bin"
        source.write_bytes(bytes(range(256)) * (CHUNK_BYTES // 256) * args.mib)
        stores = {
            int(b): RedisStore(client, "bench", root / f"cache{b}", read_batch_chunks=int(b))
            for b in args.batches.split(",")
        }
        next(iter(stores.values())).put(JOB, "file.bin", source, ttl_s=3600)
        key = next(iter(stores.values()))._key(JOB, "file.bin")

        def batched(store: RedisStore) -> None:
            shutil.rmtree(store.cache.root, ignore_errors=True)
            store.local_path(JOB, "file.bin")

        runs = {
            "baseline": lambda: chunk_per_round_trip(client, key, root / "baseline.bin"),
            **{f"batch_{b}": (lambda s=s: batched(s)) for b, s in stores.items()},
        }
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            order = list(runs.items())
            random.shuffle(order)
            for name, run in order:
                started = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - started)
        per_mib = {name: statistics.median(values) * 1000 / args.mib for name, values in seconds.items()}
        base = per_mib["baseline"]
        result = {
            "mib": args.mib,
            "rounds": args.rounds,
            "default_batch": READ_BATCH_CHUNKS,
            "ms_per_mib": {name: round(value, 3) for name, value in per_mib.items()},
            "ratio_to_baseline": {name: round(value / base, 3) for name, value in per_mib.items()},
            "round_trips": {"baseline": args.mib + 2, **{f"batch_{b}": args.mib // b + 1 for b in stores}},
            # against batch 1 (the same code, one chunk per round trip): the client time per MiB a batch
            # adds, over the round trips per MiB it saves; 0 when it adds none
            "break_even_rtt_ms": {
                f"batch_{b}": round(max(0.0, per_mib[f"batch_{b}"] - per_mib["batch_1"]) / (1 - 1 / b), 3)
                for b in stores
                if b > 1
            },
        }
        print(json.dumps(result))
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
