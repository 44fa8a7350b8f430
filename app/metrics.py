"""Prometheus metrics for the web's GET /metrics, gathered from Redis at scrape time.

Stages run in worker processes on other hosts, so their durations are aggregated in Redis (a histogram's
bucket counters per kind/stage, HINCRBY) and exposed by the web; job gauges come from the per-state sets
the track transitions keep (app/lifecycle.py), queue and worker gauges from the bookkeeping and the worker
registry: a scrape costs a few round trips, whatever the number of jobs.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from app.kinds import KINDS
from app.services import Services
from app.snapshot import Snapshot, take_snapshot

STAGE_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, math.inf)


def observe_stage(svc: Services, kind: str, stage: str, seconds: float) -> None:
    """Count one finished stage in its duration buckets (cumulative, as Prometheus expects)."""
    key = svc.jobs.keys.metric("stage_seconds", kind, stage)
    pipe = svc.redis.pipeline()
    for bound in STAGE_BUCKETS:
        if seconds <= bound:
            pipe.hincrby(key, _bucket_label(bound), 1)
    pipe.hincrbyfloat(key, "sum", seconds)
    pipe.hincrby(key, "count", 1)
    pipe.execute()


def count_submission(svc: Services, kind: str) -> None:
    svc.redis.hincrby(svc.jobs.keys.metric("submitted"), kind, 1)


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
    outstanding = GaugeMetricFamily("encore_queue_outstanding_tracks", "Tracks queued or running, per queue",
                                    labels=["queue"])
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
    histogram = HistogramMetricFamily("encore_stage_duration_seconds", "Wall time of finished stages",
                                      labels=["kind", "stage"])
    for (kind, stage), raw in snapshot.stages.items():
        if raw:
            buckets = [(_bucket_label(b), float(raw.get(_bucket_label(b), 0))) for b in STAGE_BUCKETS]
            histogram.add_metric([kind, stage], buckets, float(raw.get("sum", 0)))
    return histogram


def make_registry(svc: Services, transport_options: dict[str, Any]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EncoreCollector(svc, transport_options))
    return registry
