"""The web tier's gunicorn settings, one file for the demo, the Dockerfile and docker-compose:
`gunicorn -c gunicorn.conf.py` (a `-b` or `-w` given on the command line still wins).

Worker model: gthread, several processes of many threads each. A sync worker is held for as long as one
client takes to send its body, so two clients pausing half-way through a lip-sync upload held both of the
demo's workers and every other request (even /healthz) waited for them. Here a slow client holds one thread;
a connection that sends nothing is parked on the worker's poller without a thread; and the app puts a read
timeout (ENCORE_BODY_IDLE_S) on the socket of every request that carries a body, so a client that stops
sending is answered 408 and dropped instead of holding its thread forever. gthread needs no monkey-patching
(gevent would, under redis-py, kombu and prometheus_client); the web's work per request is short Redis round
trips, which threads serve well. Numbers come from app/core/config.py, like every setting.
"""

from typing import Any

from app.core.config import load_settings

_settings = load_settings()

wsgi_app = "app.web:create_app()"
bind = [_settings.web_bind]
workers = _settings.web_workers
# gthread, whose own refusals (414, 431, 400) answer JSON like the app's: app/http/server_errors.py
worker_class = "app.http.server_errors.JsonErrorThreadWorker"
threads = _settings.web_threads
timeout = 120  # a worker that answers no heartbeat for this long is restarted
graceful_timeout = 30
keepalive = 5
# Request heads are bounded before the app sees them (gunicorn answers 414 / 431 / 400 past these, in JSON).
limit_request_line = 8190
limit_request_fields = 100
limit_request_field_size = 8190


def post_worker_init(worker: Any) -> None:  # a gunicorn Worker: its app is `worker.wsgi`
    """Each web process also ends the tracks of canceled jobs whose stage died (app/http/sweeper.py)."""
    from app.http.sweeper import start_sweeper

    start_sweeper(worker.wsgi)
