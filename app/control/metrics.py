"""Prometheus metrics for the web's GET /metrics, gathered from Redis at scrape time.

Stages run in worker processes on other hosts, so their durations are aggregated in Redis (a histogram's
bucket counters per kind/stage, HINCRBY) and exposed by the web, with the stage's throughput: the cost units
it got through (song seconds for music, audio seconds for lip-sync, summed over the tracks one run served),
the last run's seconds per unit, and per queue the average the ETA and routing use (app/control/eta.py: weighted by
ENCORE_ETA_ALPHA; there is no second average here). Job gauges come from the per-state
sets the track transitions keep (app/control/lifecycle.py), queue and worker gauges from the bookkeeping and the
worker registry, GPU gauges from the NVML readings live workers' heartbeats carry (app/adapters/gpu.py; none on a CPU
host): a scrape costs one round trip, whatever the number of jobs.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from app.control.eta import parse_rates
from app.adapters.gpu import parse_readings
from app.core.kinds import KINDS
from app.control.scripts import script
from app.control.tenant_limits import usage
from app.control.services import Services
from app.control.snapshot import Snapshot, take_snapshot

STAGE_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, math.inf)


def observe_stage(svc: Services, kind: str, stage: str, seconds: float, units: float = 0.0) -> None:
    """Count one finished stage in its duration buckets (cumulative, as Prometheus expects) and, when it got
    `units` of work through (cost units: song or audio seconds), in its throughput."""
    key = svc.jobs.keys.stage_seconds(kind, stage)
    buckets = [_bucket_label(bound) for bound in STAGE_BUCKETS if seconds <= bound]
    script(svc.redis, "observe_stage")(keys=[key], args=[repr(float(seconds)), repr(float(units)), *buckets])


def count_submission(svc: Services, kind: str) -> None:
    svc.redis.hincrby(svc.jobs.keys.submitted, kind, 1)


def _bucket_label(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else f"{bound:g}"


class EncoreCollector(Collector):
    def __init__(self, svc: Services, transport_options: dict[str, Any]):
        self.svc = svc
        self.transport_options = transport_options

    def collect(self) -> Iterator:
        snapshot = take_snapshot(self.svc, self.transport_options)  # one round trip for the whole scrape
        yield _jobs(snapshot)
        yield _submitted(snapshot)
        yield from _queues(snapshot)
        yield _workers(snapshot)
        yield _stage_durations(snapshot)
        yield from _stage_throughput(snapshot, self.svc.settings.eta_alpha)
        yield from _gpus(snapshot)


def _jobs(snapshot: Snapshot) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily("encore_jobs", "Jobs still held in Redis, by kind and state", labels=["kind", "state"])
    for (kind, state), value in sorted(snapshot.jobs.items()):
        if value:
            gauge.add_metric([kind, state], value)
    return gauge


def _submitted(snapshot: Snapshot) -> CounterMetricFamily:
    counter = CounterMetricFamily("encore_jobs_submitted", "Jobs accepted since Redis was created", labels=["kind"])
    for kind in sorted(KINDS):
        counter.add_metric([kind], float(snapshot.submitted.get(kind, 0)))
    return counter


def _queues(snapshot: Snapshot) -> Iterator[GaugeMetricFamily]:
    waiting = GaugeMetricFamily("encore_queue_waiting_tracks", "Tracks not started yet, per queue", labels=["queue"])
    outstanding = GaugeMetricFamily(
        "encore_queue_outstanding_tracks", "Tracks queued or running, per queue", labels=["queue"]
    )
    for queue in snapshot.queues:
        waiting.add_metric([queue["name"]], queue["waiting"])
        outstanding.add_metric([queue["name"]], queue["outstanding"])
    unrouted = GaugeMetricFamily("encore_unrouted_tracks", "Tracks waiting for any live worker")
    unrouted.add_metric([], snapshot.unrouted)
    yield waiting
    yield outstanding
    yield unrouted


def _workers(snapshot: Snapshot) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily("encore_workers", "Known workers by status", labels=["status"])
    statuses = [w["status"] for w in snapshot.workers]
    for status in ("idle", "busy", "offline"):
        gauge.add_metric([status], statuses.count(status))
    return gauge


def _stage_durations(snapshot: Snapshot) -> HistogramMetricFamily:
    histogram = HistogramMetricFamily(
        "encore_stage_duration_seconds", "Wall time of finished stages", labels=["kind", "stage"]
    )
    for (kind, stage), raw in snapshot.stages.items():
        if raw:
            buckets = [(_bucket_label(b), float(raw.get(_bucket_label(b), 0))) for b in STAGE_BUCKETS]
            histogram.add_metric([kind, stage], buckets, float(raw.get("sum", 0)))
    return histogram


def _stage_throughput(snapshot: Snapshot, alpha: float) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    labels = ["kind", "stage"]
    units = CounterMetricFamily(
        "encore_stage_units",
        "Cost units (song seconds for music, audio seconds for "
        "lip-sync) finished stages got through, over every track a run served",
        labels=labels,
    )
    last = GaugeMetricFamily(
        "encore_stage_last_seconds_per_unit",
        "Wall seconds per cost unit of the stage's last finished run",
        labels=labels,
    )
    average = GaugeMetricFamily(
        "encore_stage_seconds_per_unit",
        "Wall seconds per cost unit of the stage on the "
        "queue, exponentially weighted (ENCORE_ETA_ALPHA, here the newest run "
        f"{alpha:g}): the rate its ETAs and routing use",
        labels=["queue", "kind", "stage"],
    )
    for (kind, stage), raw in snapshot.stages.items():
        if raw.get("last_s_per_unit"):
            units.add_metric([kind, stage], float(raw.get("units", 0)))
            last.add_metric([kind, stage], float(raw["last_s_per_unit"]))
    for (queue, kind, stage), rate in sorted(parse_rates(snapshot.rates).items()):
        average.add_metric([queue, kind, stage], rate)
    yield units
    yield last
    yield average


GPU_SERIES = (
    ("memory_used_bytes", "encore_gpu_memory_used_bytes", "GPU memory in use (NVML)"),
    ("memory_free_bytes", "encore_gpu_memory_free_bytes", "GPU memory free (NVML)"),
    ("memory_total_bytes", "encore_gpu_memory_total_bytes", "GPU memory in all (NVML)"),
    ("utilization", "encore_gpu_utilization_ratio", "Share of the last sample period a kernel ran (NVML)"),
)


def _gpus(snapshot: Snapshot) -> Iterator[GaugeMetricFamily]:
    """Per card of every live worker; no family at all when no worker reads NVML (a CPU host)."""
    cards = [
        (worker["name"], card)
        for worker in snapshot.workers
        if worker["status"] != "offline"
        for card in parse_readings(worker.get("gpus"))
    ]
    if not cards:
        return
    labels = ["worker", "gpu", "uuid", "name"]
    for field, name, description in GPU_SERIES:
        gauge = GaugeMetricFamily(name, description, labels=labels)
        for worker, card in cards:
            if isinstance(card.get(field), (int, float)):
                gauge.add_metric(
                    [worker, str(card.get("index", "")), str(card.get("uuid", "")), str(card.get("name", ""))],
                    float(card[field]),
                )
        yield gauge


def make_registry(svc: Services, transport_options: dict[str, Any]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EncoreCollector(svc, transport_options))
    return registry


class TenantCollector(Collector):
    """Each named tenant's usage (app/control/tenant_limits.py), read at scrape time in one round trip. Only admin
    scrapes get it (app/http/ops.py), and only for tenants from the configuration: a bounded set of labels."""

    def __init__(self, svc: Services, tenants: list[str]):
        self.svc = svc
        self.tenants = tenants

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        rows = usage(self.svc, self.tenants)
        jobs = CounterMetricFamily("encore_tenant_jobs_submitted", "Jobs a tenant submitted", labels=["tenant"])
        tracks = CounterMetricFamily("encore_tenant_tracks_submitted", "Tracks a tenant submitted", labels=["tenant"])
        gpu = CounterMetricFamily(
            "encore_tenant_gpu_seconds", "Wall seconds a tenant's stages ran on GPU queues", labels=["tenant"]
        )
        open_now = GaugeMetricFamily("encore_tenant_open_tracks", "A tenant's tracks not ended", labels=["tenant"])
        for row in rows:
            jobs.add_metric([row["tenant"]], row["jobs"])
            tracks.add_metric([row["tenant"]], row["tracks"])
            gpu.add_metric([row["tenant"]], row["gpu_seconds"])
            open_now.add_metric([row["tenant"]], row["open_tracks"])
        yield from (jobs, tracks, gpu, open_now)


def tenant_registry(svc: Services, tenants: list[str]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TenantCollector(svc, tenants))
    return registry
