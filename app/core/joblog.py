"""One log line per job event, the same shape in the web and worker logs, so `grep job=<id>` tells a
job's whole story: `job=… track=… queue=… worker=… event=… key=value …`."""

from __future__ import annotations

import logging
from typing import Any


def job_event(
    logger: logging.Logger,
    event: str,
    job_id: str,
    *,
    track: int | None = None,
    queue: str | None = None,
    worker: str | None = None,
    level: int = logging.INFO,
    **fields: Any,
) -> None:
    parts = [
        f"job={job_id}",
        f"track={'-' if track is None else track}",
        f"queue={queue or '-'}",
        f"worker={worker or '-'}",
        f"event={event}",
    ]
    parts += [f"{key}={value}" for key, value in fields.items()]
    logger.log(level, " ".join(parts))
