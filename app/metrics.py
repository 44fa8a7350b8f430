"""Prometheus metrics for the web's GET /metrics, gathered from Redis at scrape time.

Stages run in worker processes on other hosts, so their durations are aggregated in Redis (a histogram's
bucket counters per kind/stage, HINCRBY) and exposed by the web; job gauges come from the per-state sets
the track transitions keep (app/lifecycle.py), queue and worker gauges from the bookkeeping and the worker
registry: a scrape costs a few round trips, whatever the number of jobs.
"""
from __future__ import annotations

import math
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from app.kinds import KINDS
from app.routing import known_queues
from app.services import Services

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
    def __init__(self, svc: Services):
        self.svc = svc

    def collect(self) -> Iterator:
        yield self._jobs()
        yield self._submitted()
        yield from self._queues()
        yield self._workers()
        yield self._stage_durations()

    def _jobs(self) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily("encore_jobs", "Jobs still held in Redis, by kind and state",
                                  labels=["kind", "state"])
        for (kind, state), value in sorted(self.svc.jobs.job_counts().items()):
            if value:
                gauge.add_metric([kind, state], value)
        return gauge

    def _submitted(self) -> CounterMetricFamily:
        counter = CounterMetricFamily("encore_jobs_submitted", "Jobs accepted since Redis was created",
                                      labels=["kind"])
        raw = self.svc.redis.hgetall(self.svc.jobs.keys.metric("submitted"))
        for kind in sorted(KINDS):
            counter.add_metric([kind], float(raw.get(kind, 0)))
        return counter

    def _queues(self) -> Iterator[GaugeMetricFamily]:
        waiting = GaugeMetricFamily("encore_queue_waiting_tracks", "Tracks not started yet, per queue",
                                    labels=["queue"])
        outstanding = GaugeMetricFamily("encore_queue_outstanding_tracks", "Tracks queued or running, per queue",
                                        labels=["queue"])
        queues = known_queues(self.svc)
        pipe = self.svc.redis.pipeline(transaction=False)
        for queue in queues:
            pipe.zcard(self.svc.jobs.waiting_key(queue))
            pipe.zcard(self.svc.jobs.load_key(queue))
        pipe.zcard(self.svc.jobs.keys.unrouted)
        replies = pipe.execute()
        for index, queue in enumerate(queues):
            waiting.add_metric([queue], replies[2 * index])
            outstanding.add_metric([queue], replies[2 * index + 1])
        unrouted = GaugeMetricFamily("encore_unrouted_tracks", "Tracks waiting for any live worker")
        unrouted.add_metric([], replies[-1])
        yield waiting
        yield outstanding
        yield unrouted

    def _workers(self) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily("encore_workers", "Known workers by status", labels=["status"])
        statuses = [w["status"] for w in self.svc.workers.workers()]
        for status in ("idle", "busy", "offline"):
            gauge.add_metric([status], statuses.count(status))
        return gauge

    def _stage_durations(self) -> HistogramMetricFamily:
        histogram = HistogramMetricFamily("encore_stage_duration_seconds", "Wall time of finished stages",
                                          labels=["kind", "stage"])
        pairs = [(kind, stage.name) for kind in sorted(KINDS) for stage in KINDS[kind].stages]
        pipe = self.svc.redis.pipeline(transaction=False)
        for kind, stage in pairs:
            pipe.hgetall(self.svc.jobs.keys.metric("stage_seconds", kind, stage))
        for (kind, stage), raw in zip(pairs, pipe.execute()):
            if raw:
                buckets = [(_bucket_label(b), float(raw.get(_bucket_label(b), 0))) for b in STAGE_BUCKETS]
                histogram.add_metric([kind, stage], buckets, float(raw.get("sum", 0)))
        return histogram


def make_registry(svc: Services) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EncoreCollector(svc))
    return registry
