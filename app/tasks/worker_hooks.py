"""Worker life cycle: a heartbeat thread in the master (registry with its cards' NVML readings, routing of
parked tracks, the reaper of app/control/recovery.py, artifact sweep); per-child set-up (torch threads, optional model
preload). The master never touches CUDA. What a crashed predecessor left running is the reaper's: its lease
expires."""

from __future__ import annotations

import logging
import os
import threading
import time

from redis.exceptions import ConnectionError as RedisConnectionError, RedisError
from celery.signals import worker_init, worker_process_init, worker_ready, worker_shutdown, worker_shutting_down

from app.adapters import tracing
from app.adapters.celery_app import celery
from app.adapters.gpu import GpuProbe
from app.core.kinds import KINDS
from app.core.queues import is_cpu_queue
from app.control.eta import announce_slots, configured_slots
from app.control.recovery import reap, release_dead_leases
from app.control.routing import dispatch_unrouted, rebalance
from app.control.services import Services, services
from app.tasks.scratch import sweep_scratch, sweep_workdirs

log = logging.getLogger("encore.worker")

SWEEP_EVERY_S = 300.0
_stop = threading.Event()


def _consumed_queues() -> list[str]:
    return sorted(celery.amqp.queues.consume_from or celery.amqp.queues)


def cpu_role() -> bool:
    """This worker consumes only companion queues: the host's CPU-stage worker (no models, no GPU)."""
    queues = _consumed_queues()
    return bool(queues) and all(is_cpu_queue(queue) for queue in queues)


def _worker_info(svc: Services, hostname: str) -> dict[str, object]:
    """What the heartbeat registers (app/control/workers.py), read once at start."""
    return {
        "queue": ",".join(_consumed_queues()),
        "role": "cpu" if cpu_role() else "gpu",
        "pid": os.getpid(),
        "hostname": hostname,
        "runtime_mode": svc.settings.runtime_mode,
        "profile": svc.settings.music_profile,
        "music_engine": svc.settings.music_engine,
        "kinds": "" if cpu_role() else ",".join(sorted(KINDS)),
        # ready only once its child loaded them (readiness, rebalance); the CPU-stage worker loads none
        "preload": int(svc.settings.preload_models and not cpu_role()),
        "pinned_to": _device_claim(),
        "started_at": time.time(),
    }


def _heartbeat_loop(hostname: str) -> None:
    svc = services()
    info = _worker_info(svc, hostname)
    gpus = GpuProbe(svc.settings.cuda_visible_devices)  # NVML, not CUDA: safe in the forking master
    last_sweep: float | None = None  # the first heartbeat sweeps: a restarted worker cleans up after its last run
    announced = cpu_role()  # a GPU worker says at its first beat whether its queues run the engine (their order)
    unreachable_since: float | None = None  # Redis down: said once when it goes and once when it is back
    while not _stop.is_set():
        try:
            svc.workers.heartbeat(hostname, {**info, **gpus.heartbeat_fields()})
            if not announced:
                for queue in _consumed_queues():
                    announce_slots(svc, queue, configured_slots(svc.settings))
                announced = True
            reap(svc, celery)
            dispatch_unrouted(svc, celery)  # parked tracks, including those the reaper just parked
            rebalance(svc, celery)  # an idle queue takes a track waiting behind a running one elsewhere
            removed = sweep_scratch(svc) + sweep_workdirs(svc)  # this host's folders: a few reads, every beat
            if last_sweep is None or time.monotonic() - last_sweep > SWEEP_EVERY_S:
                last_sweep = time.monotonic()
                removed += svc.artifacts.sweep(lambda job_id: svc.jobs.job(job_id) is not None)
            if removed:
                log.info("event=sweep removed=%d", len(removed))
            if unreachable_since is not None:
                log.warning("event=redis_back after_s=%.1f", time.monotonic() - unreachable_since)
                unreachable_since = None
        except RedisConnectionError as exc:  # an outage, not a bug: one line, not a traceback per beat
            if unreachable_since is None:
                unreachable_since = time.monotonic()
                log.warning("event=redis_unreachable reason=%r; heartbeats retry until it is back", exc)
        except Exception:
            log.exception("heartbeat failed; retrying")
        _stop.wait(svc.settings.heartbeat_s)


class _CancelOnConnectionLossWithoutTraceback(logging.Filter):
    """Celery cancels a running acks-late task when the broker connection drops
    (worker_cancel_long_running_tasks_on_connection_loss) and, as Redis is down, the cancel's own bookkeeping
    fails too: it logs that with a traceback of Redis's internals. An outage is expected here (the stage's
    lease and the reaper recover the track): the line keeps the exception, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and str(record.msg).startswith("Failed to cancel active request"):
            record.msg = f"{record.getMessage()} ({record.exc_info[1]!r})"  # formatted: no '%' left to misread
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


logging.getLogger("celery.worker.consumer.consumer").addFilter(_CancelOnConnectionLossWithoutTraceback())


def _device_claim() -> str:
    """What the worker is pinned to, without initialising CUDA in the (forking) master."""
    visible = services().settings.cuda_visible_devices
    return f"cuda (CUDA_VISIBLE_DEVICES={visible})" if visible not in ("", "-1") else "cpu"


@worker_init.connect
def take_over_from_a_dead_predecessor(sender=None, **_: object) -> None:
    """Before this worker consumes anything: the stages its previous run (same name, so this host) held when
    it was killed are dead, so their leases go now and the reaper sends those tracks back, first in line as
    started tracks (app/core/priority.py), instead of after the lease expires behind the jobs queued since:
    the oldest job keeps its place."""
    hostname = getattr(sender, "hostname", None)
    svc = services()
    if not hostname or _consumed_queues() == [svc.settings.webhook_queue]:
        return
    try:
        released = release_dead_leases(svc, hostname)
        if released:
            svc.workers.heartbeat(hostname, _worker_info(svc, hostname))  # live: the tracks go back to its queue
            reap(svc, celery)
            # a warning: logging is not set up yet, and only warnings reach the log before it is
            log.warning("worker=%s event=took_over_dead_stages count=%d", hostname, released)
    except RedisError as exc:  # Redis down at start: the worker waits for it, and the leases expire as usual
        log.warning("worker=%s event=take_over_skipped reason=%r", hostname, exc)


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
    svc = services()
    svc.redis.hdel(svc.workers.keys.worker(hostname), "stopping")  # a previous run's warm shutdown, if it left one
    threading.Thread(target=_heartbeat_loop, args=(hostname,), name="encore-heartbeat", daemon=True).start()
    log.info("worker=%s event=ready queues=%s", hostname, ",".join(_consumed_queues()))


@worker_shutting_down.connect
def mark_stopping(sender=None, **_: object) -> None:
    """A warm shutdown began: the child's backbone engine stops admitting tracks and drains (app/tasks/engine.py),
    so the shutdown waits for the tracks it holds, not for a queue that keeps filling."""
    hostname = str(sender) if sender else ""
    if hostname:
        try:
            services().workers.update(hostname, stopping="1")
        except Exception:  # a shutdown goes on without Redis; the engine's admission cap ends it anyway
            log.warning("worker=%s event=stopping_unrecorded", hostname, exc_info=True)


@worker_shutdown.connect
def stop_heartbeat(sender=None, **_: object) -> None:
    _stop.set()
    hostname = getattr(sender, "hostname", None)
    if hostname:
        svc = services()
        if _consumed_queues() != [svc.settings.webhook_queue]:
            svc.redis.delete(svc.workers.keys.worker(hostname))  # offline at once, not after TTL


def import_cpu_stage_code(worker: str) -> None:
    """The CPU-stage worker's child imports the code its stages run before it takes one (the music stages module
    pulls in megatron-core: ~4 s on a cold import here): otherwise the first export after a start is that much
    slower for its client, and the ETA learns an export rate several times the real one from it."""
    from app.tasks import lipsync, music

    started = time.monotonic()
    music.stage_code()
    lipsync.stage_code()
    log.info("worker=%s event=stage_code_imported seconds=%.2f", worker, time.monotonic() - started)


@worker_process_init.connect
def init_child(sender=None, **_: object) -> None:
    """In each pool child: thread count; in the CPU-stage worker the stage code imported up front, elsewhere the
    models loaded up front when ENCORE_PRELOAD=1 (each kind whose models loaded is recorded in the worker's registry
    entry: what /readyz reads)."""
    svc = services()
    tracing.configure(svc.settings, "worker")  # in the child: the exporter's thread must not cross a fork
    import torch

    if svc.settings.torch_threads > 0:
        torch.set_num_threads(svc.settings.torch_threads)
    if cpu_role():
        import_cpu_stage_code(str(sender or ""))
    elif svc.settings.preload_models:  # the CPU-stage worker runs no model
        from app.tasks import lipsync, music

        loaded: list[str] = []
        for kind, preload in (("music", music.preload), ("lipsync", lipsync.preload)):
            preload()
            loaded.append(kind)
            if sender:  # the worker's name (celery sends it with this signal)
                svc.workers.record_models(str(sender), loaded, os.getpid())
        log.info("worker=%s event=models_loaded kinds=%s", sender, ",".join(loaded))
