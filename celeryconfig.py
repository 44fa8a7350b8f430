"""Celery settings for Encore, derived from app.core.config so there is one source of truth.

Why these values (see shared/DESIGN.md §1):
- prefork with one child per GPU worker: the master keeps answering inspect/heartbeats while a stage runs,
  hard time limits are enforced, and revoke(terminate=True) works; CUDA is only touched in the child.
- acks_late + prefetch 1 + reject_on_worker_lost: a crash never loses a stage; redeliveries are capped by
  the stage machinery (app/tasks/stage.py), not here.
- priority steps: later stages of a started job outrank the first stage of every other job (FIFO across
  stages); first stages go by their job's priority level (app/core/priority.py: high 3, normal 6, low 9).
"""

from app.core.config import load_settings
from app.adapters.redis_conn import celery_connection

_settings = load_settings()

_connection = celery_connection(_settings)  # REDIS_URL, or sentinel:// URLs with REDIS_SENTINELS
broker_url = _connection["broker_url"]
result_backend = _connection["result_backend"]
broker_connection_retry_on_startup = True

task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]

task_acks_late = True
task_acks_on_failure = True  # a stage that raised is done with (its track is marked failed)
task_acks_on_timeout = True  # a hard time limit fails the track; never redeliver it
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1
worker_concurrency = 1
worker_pool = "prefork"
worker_proc_alive_timeout = 120  # children may load models in worker_process_init
worker_send_task_events = True
task_send_sent_event = True
task_track_started = True
worker_cancel_long_running_tasks_on_connection_loss = True

result_expires = _settings.result_expires_s
task_default_queue = "gpu0"
task_create_missing_queues = True

broker_transport_options = {
    "visibility_timeout": _settings.visibility_timeout_s,
    "priority_steps": list(range(10)),
    "sep": ":",
    "queue_order_strategy": "priority",
    **_connection.get("broker_transport_options", {}),  # master_name (and the sentinels' password) with Sentinel
}
result_backend_transport_options = {
    "visibility_timeout": _settings.visibility_timeout_s,
    **_connection.get("result_backend_transport_options", {}),
}
visibility_timeout = _settings.visibility_timeout_s
