"""What a client's poll shows of a job, rendered when the job is written rather than each time it is read.

Polls outnumber writes by far (every client asks every second or so; a track changes a few times a minute), so
the transitions keep each job's reply ready in its view hash (`{p}:job:{id}:view`, lua/job_view.lua): the
job's fields, each track's fields as JSON without the ones clients never see, its seed and download links. A
poll (lua/read_job.lua's client view) reads that hash and adds only what moves without a write to the job:
queue positions, workers' status, the cancel flag, webhook deliveries and the ETA, whose inputs it caches in
the view while the queues' members and the learned rates stay as they were (lua/estimate.lua's
cached_job_eta). harness/records.public_record is the reference the reply is tested against; the web serves
this text for polls, lists, cancels and retries alike (one source of the client record).

Every write of a track goes through the state machine (lua/transition.lua), which renders that track's part; a
job whose view is missing (written before views existed) has it rendered by its first poll.
"""

from __future__ import annotations

from typing import Iterable

JOBS_URL = "/api/v1/jobs/"  # a job's download links are under it
# Internal bookkeeping: Celery ids, costs, order tags, parameters, and the deaths count its error messages tell.
PRIVATE_TRACK_FIELDS = ("task_ids", "cost", "seq", "fifo", "params", "deaths")


def lua_view(json_fields: Iterable[str]) -> str:
    """The view's constants as Lua locals for lua/job_view.lua: VIEW_JSON (the track fields stored as JSON,
    `json_fields`: app/control/lifecycle.JSON_FIELDS), VIEW_HIDDEN and VIEW_URL."""
    json_set = ", ".join(f'["{name}"] = true' for name in json_fields)
    hidden = ", ".join(f'["{name}"] = true' for name in PRIVATE_TRACK_FIELDS)
    return f"local VIEW_JSON = {{{json_set}}}\nlocal VIEW_HIDDEN = {{{hidden}}}\nlocal VIEW_URL = '{JOBS_URL}'\n"
