"""Worker life cycle: a heartbeat thread in the master (registry with its cards' NVML readings, routing of
parked tracks, the reaper of app/control/recovery.py, artifact sweep); per-child set-up (torch threads, optional model
preload). The master never touches CUDA. What a crashed predecessor left running is the reaper's: its lease
expires."""

from __future__ import annotations

import logging
import os
import threading
import time

from celery.signals import worker_process_init, worker_ready, worker_shutdown

from app.adapters import tracing
from app.adapters.celery_app import celery
from app.adapters.gpu import GpuProbe
from app.core.kinds import KINDS
from app.control.recovery import reap
from app.control.routing import dispatch_unrouted, rebalance
from app.control.services import services
from app.tasks.stage import sweep_scratch, sweep_workdirs

log = logging.getLogger("encore.worker")

SWEEP_EVERY_S = 300.0
_stop = threading.Event()


def _consumed_queues() -> list[str]:
    return sorted(celery.amqp.queues.consume_from or celery.amqp.queues)


def _heartbeat_loop(hostname: str) -> None:
    svc = services()
    queues = _consumed_queues()
    info = {
        "queue": ",".join(queues),
        "pid": os.getpid(),
        "hostname": hostname,
        "runtime_mode": svc.settings.runtime_mode,
        "profile": svc.settings.music_profile,
        "music_engine": svc.settings.music_engine,
        "kinds": ",".join(sorted(KINDS)),
        "preload": int(svc.settings.preload_models),  # ready only once its child loaded them (readiness, rebalance)
        "pinned_to": _device_claim(),
        "started_at": time.time(),
    }
    gpus = GpuProbe(svc.settings.cuda_visible_devices)  # NVML, not CUDA: safe in the forking master
    last_sweep: float | None = None  # the first heartbeat sweeps: a restarted worker cleans up after its last run
    while not _stop.is_set():
        try:
            svc.workers.heartbeat(hostname, {**info, **gpus.heartbeat_fields()})
            reap(svc, celery)
            dispatch_unrouted(svc, celery)  # parked tracks, including those the reaper just parked
            rebalance(svc, celery)  # an idle queue takes a track waiting behind a running one elsewhere
            if last_sweep is None or time.monotonic() - last_sweep > SWEEP_EVERY_S:
                last_sweep = time.monotonic()
                removed = svc.artifacts.sweep(lambda job_id: svc.jobs.job(job_id) is not None)
                removed += sweep_scratch(svc) + sweep_workdirs(svc)
                if removed:
                    log.info("event=sweep removed=%d", len(removed))
        except Exception:
            log.exception("heartbeat failed; retrying")
        _stop.wait(svc.settings.heartbeat_s)


def _device_claim() -> str:
    """What the worker is pinned to, without initialising CUDA in the (forking) master."""
    visible = services().settings.cuda_visible_devices
    return f"cuda (CUDA_VISIBLE_DEVICES={visible})" if visible not in ("", "-1") else "cpu"


@worker_ready.connect
def start_heartbeat(sender=None, **_: object) -> None:
    """A GPU worker joins the registry and runs the heartbeat; the webhook worker (consuming only
    ENCORE_WEBHOOK_QUEUE) stays out of the registry, so no track is ever routed to it, and pumps the outbox."""
    hostname = sender.hostname if sender is not None else celery.conf.get("worker_name", "worker")
    _stop.clear()
    if _consumed_queues() == [services().settings.webhook_queue]:
        from app.tasks.webhooks import pump_forever

        threading.Thread(target=pump_forever, args=(hostname, _stop), name="encore-webhooks", daemon=True).start()
        log.info("worker=%s event=ready role=webhooks", hostname)
        return
    threading.Thread(target=_heartbeat_loop, args=(hostname,), name="encore-heartbeat", daemon=True).start()
    log.info("worker=%s event=ready queues=%s", hostname, ",".join(_consumed_queues()))


@worker_shutdown.connect
def stop_heartbeat(sender=None, **_: object) -> None:
    _stop.set()
    hostname = getattr(sender, "hostname", None)
    if hostname:
        svc = services()
        if _consumed_queues() != [svc.settings.webhook_queue]:
            svc.redis.delete(svc.workers.keys.worker(hostname))  # offline at once, not after TTL


@worker_process_init.connect
def init_child(sender=None, **_: object) -> None:
    """In each pool child: thread count, and models loaded up front when ENCORE_PRELOAD=1; each kind whose
    models loaded is recorded in the worker's registry entry (what /readyz reads)."""
    svc = services()
    tracing.configure(svc.settings, "worker")  # in the child: the exporter's thread must not cross a fork
    import torch

    if svc.settings.torch_threads > 0:
        torch.set_num_threads(svc.settings.torch_threads)
    if svc.settings.preload_models:
        from app.tasks import lipsync, music

        loaded: list[str] = []
        for kind, preload in (("music", music.preload), ("lipsync", lipsync.preload)):
            preload()
            loaded.append(kind)
            if sender:  # the worker's name (celery sends it with this signal)
                svc.workers.record_models(str(sender), loaded, os.getpid())
        log.info("worker=%s event=models_loaded kinds=%s", sender, ",".join(loaded))
