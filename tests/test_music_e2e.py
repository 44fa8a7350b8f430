"""A whole music job through HTTP on two real CPU workers (gpu0, gpu1) with the tiny models."""

from __future__ import annotations

import io
import json
import subprocess
import threading
import wave

import redis
import requests

from harness.processes import wait_until

HOP = 2048
RATE = 44100
STAGE_STATES = ["backbone", "superres", "decoding", "exporting"]


class EventLog:
    """Every state/progress event the job store publishes, collected from Redis pub/sub."""

    def __init__(self, redis_url: str):
        self.events: list[dict] = []
        self._pubsub = redis.Redis.from_url(redis_url, decode_responses=True).pubsub()
        self._pubsub.psubscribe("encore:events:*")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.1)
            if message and message["type"] == "pmessage":
                self.events.append(json.loads(message["data"]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pubsub.close()


def ffprobe_duration(data: bytes, tmp_path) -> float:
    path = tmp_path / "probe.mp3"
    path.write_bytes(data)
    probe = subprocess.run(
        ["ffprobe", "-v", "error", "-show_entries", "format=duration", "-of", "csv=p=0", str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return float(probe.stdout.strip())


def test_full_music_job_over_http_on_two_workers(make_stack, tmp_path):
    stack = make_stack()
    stack.start_worker(0)
    stack.start_worker(1)
    events = EventLog(stack.redis_url)
    duration = 3.0
    reply = requests.post(
        f"{stack.base_url}/api/v1/music",
        json={
            "mode": "vocal",
            "tags": "rock, male vocal",
            "lyrics": "[verse]\nla la la\nna na",
            "duration_s": duration,
            "num_tracks": 2,
            "seed": 11,
        },
        timeout=10,
    )
    assert reply.status_code == 202, reply.text
    job_id = reply.json()["job_id"]
    assert reply.json()["status_url"] == f"/api/v1/jobs/{job_id}"

    record = wait_until(
        lambda: (lambda r: r if r["state"] not in ("queued", "running") else None)(
            requests.get(f"{stack.base_url}/api/v1/jobs/{job_id}", timeout=5).json()
        ),
        180,
        0.2,
        "job end",
    )
    events.close()
    assert record["state"] == "done", record
    tracks = record["tracks"]
    assert {t["queue"] for t in tracks} == {"gpu0", "gpu1"}
    assert {t["worker"].split("@")[0] for t in tracks} == {"gpu0", "gpu1"}

    for track in tracks:
        seen = [e for e in events.events if e["job_id"] == job_id and e["track"] == track["track"]]
        states = [e["state"] for e in seen if "state" in e]
        assert [s for s in STAGE_STATES if s in states] == STAGE_STATES, states
        assert states[-1] == "done"
        for stage in ("backbone", "superres", "decode", "export"):
            timing = track["stages"][stage]
            assert timing["finished_at"] >= timing["started_at"] and timing["duration_s"] >= 0
        partial = [e["progress"] for e in seen if e.get("progress", 0) not in (0, 1)]
        assert partial, "no intermediate progress was published"
        assert track["progress"] == 1.0

        wav_bytes = requests.get(f"{stack.base_url}/api/v1/jobs/{job_id}/tracks/{track['track']}.wav", timeout=10)
        assert wav_bytes.status_code == 200 and wav_bytes.headers["Content-Type"] == "audio/wav"
        with wave.open(io.BytesIO(wav_bytes.content)) as wav:
            assert wav.getframerate() == RATE and wav.getnchannels() == 2 and wav.getsampwidth() == 2
            assert abs(wav.getnframes() - duration * RATE) <= HOP
        mp3 = requests.get(f"{stack.base_url}/api/v1/jobs/{job_id}/tracks/{track['track']}.mp3", timeout=10)
        assert mp3.status_code == 200 and mp3.headers["Content-Type"] == "audio/mpeg"
        assert abs(ffprobe_duration(mp3.content, tmp_path) - duration) < 0.15
        ranged = requests.get(
            f"{stack.base_url}/api/v1/jobs/{job_id}/tracks/{track['track']}.mp3",
            headers={"Range": "bytes=0-99"},
            timeout=10,
        )
        assert ranged.status_code == 206 and ranged.content == mp3.content[:100]

    assert tracks[0]["seed"] != tracks[1]["seed"]
    wav0 = requests.get(f"{stack.base_url}/api/v1/jobs/{job_id}/tracks/0.wav", timeout=10).content
    wav1 = requests.get(f"{stack.base_url}/api/v1/jobs/{job_id}/tracks/1.wav", timeout=10).content
    assert wav0 != wav1, "two tracks with different seeds produced identical audio"
    assert requests.get(f"{stack.base_url}/api/v1/jobs/{job_id}/tracks/2.mp3", timeout=5).status_code == 404

    status = requests.get(f"{stack.base_url}/api/v1/status", timeout=5).json()
    by_queue = {w["queue"]: w for w in status["workers"]}
    assert by_queue["gpu0"]["status"] == "idle" and by_queue["gpu0"]["device"] == "cpu"
    assert by_queue["gpu1"]["runtime_mode"] == "keep_loaded" and by_queue["gpu1"]["music_engine"] == "torch"
    assert all(q["outstanding"] == 0 for q in status["queues"])
    for gpu, proc in stack.workers.items():
        maps = open(f"/proc/{proc.pid}/maps").read()
        assert "libtorch" not in maps, f"worker gpu{gpu}'s prefork master imported torch (CUDA after fork breaks)"
