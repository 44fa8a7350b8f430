"""The web's share of recovery: a daemon thread in each web process that applies the cancel's lease rule
(app/control/recovery.end_dead_cancels) every ENCORE_HEARTBEAT_S. Workers' heartbeats apply it too, but a
cancel must end a dead stage's track even while no worker is live (all of them crashed, or a one-card host
whose only worker died): the web is then the process that is still there. gunicorn starts it in each worker
process once the app is loaded (gunicorn.conf.py's `post_worker_init`); each pass costs one ZRANGE while no
cancel is pending, and the transitions it tries are atomic, so several web processes sweeping is harmless."""

from __future__ import annotations

import logging
import threading

import redis
from flask import Flask

from app.control.recovery import end_dead_cancels
from app.http.context import EXTENSION, WebContext

log = logging.getLogger("encore.web")


def start_sweeper(app: Flask) -> threading.Event | None:
    """Start the sweeper for `app`'s services; set the returned event to stop it. None for an app that is not
    Encore's (the gunicorn config also serves others: the benches' baselines): nothing to sweep for it."""
    shared: WebContext | None = getattr(app, "extensions", {}).get(EXTENSION)
    if shared is None:
        return None
    stop = threading.Event()
    threading.Thread(target=_sweep_forever, args=(shared, stop), name="encore-cancel-sweeper", daemon=True).start()
    return stop


def _sweep_forever(shared: WebContext, stop: threading.Event) -> None:
    period = max(shared.settings.heartbeat_s, 0.2)
    while not stop.wait(period):
        try:
            end_dead_cancels(shared.services, shared.transport_options)
        except redis.RedisError as exc:  # an outage: the next pass tries again; anything else is a bug and stops
            log.warning("event=cancel_sweep_failed error=%s", exc)
