"""/metrics: per-GPU series from the NVML readings live workers' heartbeats carry (none on this CPU host),
and per-stage throughput from the stages that finished. Real Redis, real workers, the real NVML probe."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prometheus_client import generate_latest

from app.control import eta
from app.core.config import Settings
from app.adapters.gpu import GpuProbe, parse_readings, visible_indices
from app.control.metrics import make_registry, observe_stage
from app.control.services import build_services
from harness.stack import unit_services

STAGES = ("backbone", "superres", "decode", "export")


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _metrics(stack) -> str:
    reply = stack.client.get("/metrics")
    assert reply.status_code == 200
    return reply.get_data(as_text=True)


@pytest.mark.slow  # a job on a worker (~7 s here)
def test_no_gpu_series_on_a_cpu_host_and_throughput_gauges_once_a_job_finished(make_stack):
    assert not GpuProbe("0").available and GpuProbe("").heartbeat_fields() == {}  # no NVIDIA driver here
    stack = make_stack()
    stack.start_worker(0)
    before = _metrics(stack)
    assert "encore_stage_seconds_per_unit{" not in before  # nothing finished yet
    job_id = stack.submit_music(duration_s=2.0, num_tracks=2)
    assert stack.wait_job(job_id)["state"] == "done"

    worker = stack.worker_status(0)
    assert "gpus" not in stack.redis.hgetall(f"encore:worker:{worker['name']}")  # the heartbeat carries no cards
    text = _metrics(stack)
    assert "encore_gpu" not in text, [line for line in text.splitlines() if "encore_gpu" in line]
    samples = _samples(text)
    rates = eta.learned(stack.app.config["SERVICES"])
    for stage in STAGES:
        labels = (("kind", "music"), ("stage", stage))
        # two tracks of 2 s: 4 song seconds through every stage, batched into one run or not
        assert samples[("encore_stage_units_total", labels)] == pytest.approx(4.0), stage
        # the average is the one the queue's ETAs use
        average = samples[("encore_stage_seconds_per_unit", (("kind", "music"), ("queue", "gpu0"), ("stage", stage)))]
        assert average > 0 and average == pytest.approx(rates[("gpu0", "music", stage)], rel=1e-6), stage
        assert samples[("encore_stage_last_seconds_per_unit", labels)] > 0, stage
        runs = samples[("encore_stage_duration_seconds_count", labels)]
        if runs == 1:  # a single run: its seconds per unit are its duration over the 4 units
            seconds = samples[("encore_stage_duration_seconds_sum", labels)]
            assert samples[("encore_stage_last_seconds_per_unit", labels)] == pytest.approx(seconds / 4, rel=1e-6)
    assert ("encore_stage_units_total", (("kind", "lipsync"), ("stage", "prepare"))) not in samples


def test_gpu_readings_of_live_workers_are_exposed_per_card(make_stack):
    """The web side of what a GPU worker's heartbeat writes (GpuProbe.heartbeat_fields' shape); an offline
    worker's cards go with it."""
    stack = make_stack()
    svc = stack.app.config["SERVICES"]
    card = {
        "index": 1,
        "uuid": "GPU-1234",
        "name": "NVIDIA H200",
        "memory_used_bytes": 2 * 2**30,
        "memory_free_bytes": 139 * 2**30,
        "memory_total_bytes": 141 * 2**30,
        "utilization": 0.42,
    }
    svc.workers.heartbeat("gpu1@host", {"queue": "gpu1", "gpus": json.dumps([card])})
    samples = _samples(_metrics(stack))
    labels = (("gpu", "1"), ("name", "NVIDIA H200"), ("uuid", "GPU-1234"), ("worker", "gpu1@host"))
    assert samples[("encore_gpu_memory_used_bytes", labels)] == 2 * 2**30
    assert samples[("encore_gpu_memory_free_bytes", labels)] == 139 * 2**30
    assert samples[("encore_gpu_memory_total_bytes", labels)] == 141 * 2**30
    assert samples[("encore_gpu_utilization_ratio", labels)] == pytest.approx(0.42)
    svc.redis.delete("encore:worker:gpu1@host")  # missed its heartbeats: offline
    assert "encore_gpu" not in _metrics(stack)


def test_a_stage_run_is_counted_in_its_histogram_units_and_last_rate(redis_base_url, tmp_path):
    svc = unit_services(redis_base_url, 501, tmp_path)
    observe_stage(svc, "music", "decode", 10.0, units=5.0)  # 2 s per song second
    observe_stage(svc, "music", "decode", 4.0, units=4.0)  # then 1
    observe_stage(svc, "music", "decode", 3.0)  # no units (unknown cost): duration only
    raw = svc.redis.hgetall(svc.jobs.keys.stage_seconds("music", "decode"))
    assert float(raw["units"]) == 9.0 and float(raw["last_s_per_unit"]) == 1.0
    assert (raw["count"], float(raw["sum"]), raw["5"], raw["10"]) == ("3", 17.0, "2", "3")


def test_the_metric_average_is_the_etas_one_with_its_alpha(redis_base_url, tmp_path):
    """ENCORE_ETA_ALPHA weighs the one seconds-per-unit average, which both the ETA and /metrics read."""
    svc = unit_services(redis_base_url, 501, tmp_path)
    svc = build_services(Settings(redis_url=svc.settings.redis_url, artifact_dir=tmp_path, eta_alpha=0.5))
    eta.learn(svc, "gpu1", "music", "decode", seconds=10.0, cost=5.0)  # 2 s per song second
    eta.learn(svc, "gpu1", "music", "decode", seconds=4.0, cost=4.0)  # then 1
    samples = _samples(generate_latest(make_registry(svc, {})).decode())
    average = samples[("encore_stage_seconds_per_unit", (("kind", "music"), ("queue", "gpu1"), ("stage", "decode")))]
    assert average == pytest.approx(2.0 + 0.5 * (1.0 - 2.0))
    assert average == pytest.approx(eta.learned(svc)[("gpu1", "music", "decode")])
    # the ETA's seconds for one song second: this rate, and the three stages not learned yet at their share
    assert eta.new_track_seconds(svc, "gpu1", "music", 1.0) == pytest.approx(average + 3 * 0.25)


def test_a_worker_reports_the_cards_its_cuda_visible_devices_names():
    uuids = ["GPU-aaaa-1", "GPU-bbbb-2", "GPU-cccc-3"]
    assert visible_indices("", uuids) == [0, 1, 2]  # unpinned: every card
    assert visible_indices("2", uuids) == [2]
    assert visible_indices("1,0", uuids) == [1, 0]
    assert visible_indices("GPU-bbbb", uuids) == [1]
    assert visible_indices("0,7,1", uuids) == [0]  # CUDA stops at the first entry it cannot use
    assert visible_indices("-1", uuids) == [] and visible_indices("MIG-x", uuids) == []
    assert parse_readings(None) == [] and parse_readings("not json") == [] and parse_readings('[{"index": 0}]')
