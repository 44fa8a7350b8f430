"""Drop-in HTTP contract of the Khala reference backend (POST /generate, GET /job/<id>, track downloads,
GET /status, GET /tags), served as a thin layer over Encore's own jobs: requests are translated into the
native MusicRequest and submitted through app/http/submissions.py; replies are read from the same job records.
Field names and strings are the reference's, exactly. One module-level blueprint, mounted twice by
`register` (at ENCORE_COMPAT_PREFIX and under /api); its views read the application's handles (`context()`).
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from flask import Blueprint, Flask, jsonify, request, send_file
from flask.typing import ResponseReturnValue

from app.adapters.redis_conn import decoded_members
from app.control import idempotency
from app.http.context import context
from app.http.guards import tenant
from app.http.replies import KHALA_BLUEPRINTS
from app.http.submit import IDEMPOTENCY_HEADER, idempotency_key, submit_once
from app.http.http_input import BodyError, json_object
from app.core.kinds import CANCELED, DONE, FAILED, MUSIC, QUEUED, first_unfinished
from app.http.openapi import DOWNLOAD_REPLIES, TOO_MANY, documented, forbidden_to_tenant
from app.http.ratelimit import check_submit_rate
from app.http.schemas import KhalaAccepted, KhalaGenerate, KhalaJob, KhalaStatus, untokenizable
from app.control.eta import job_readings
from app.control.services import Services
from app.control.snapshot import KHALA_STATUS_PARTS, take_snapshot
from app.http.submissions import RequestError, longest_song, submit_music, validate_music

NUM_TRACKS = 2
DEFAULT_TAGS = Path(__file__).with_name("khala_tags.json")
TRACK_STATUS = {
    QUEUED: "queued",
    "backbone": "generating",
    "superres": "superres",
    "decoding": "decoding",
    "exporting": "decoding",
    DONE: "done",
    FAILED: "error",
    CANCELED: "error",
}
NATIVE_TO_CONTRACT_FIELD = {"duration_s": "duration", "top_k": "top_k_bb"}
# The backbone's detail: "done/expected tokens", with " · R tok/s" once the run's rate means something
# (app/pipeline/music/stages.TokenRate).
TOKENS = re.compile(r"^(\d+)/(\d+) tokens(?: · (\d+) tok/s)?$")
# A detail that says its stage is loading a model starts so (app/pipeline/music/stages.loading_detail), and no other.
LOADING = "loading "
# Each music stage's share of a track's whole work, in stage order: the one percentage the Khala frontend shows
# runs over all four stages (finished stages' shares + the running stage's share x its progress), so it only
# moves forward as stages change. Fixed shares, roughly the stages' times (the backbone writes the song token by
# token; super-resolution is a few dozen passes; the codec and the mp3 export take seconds): a share measured
# per job would move the figure backwards whenever it was corrected.
STAGE_SHARES = {"backbone": 0.75, "superres": 0.17, "decode": 0.05, "export": 0.03}
TAGS_SCHEMA = {
    "type": "object",
    "additionalProperties": {
        "type": "object",
        "required": ["label", "tags"],
        "properties": {"label": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    },
}


def _error(status: int, message: str, field: str | None = None):
    """The reference's error shape ({"status": "error", "error"}), with the field named as Encore's errors do."""
    return jsonify({"status": "error", "error": message, **({"field": field} if field else {})}), status


def _whole(body: dict[str, Any], field: str, default: int) -> int:
    """An integer field as the reference's (lax) pydantic reads it: 3, 3.0 or "3"; not 2.5, "x" or true."""
    value = body.get(field, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]{1,9}\s*", value, re.ASCII):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(field, "must be a whole number")
    return value


def _real(body: dict[str, Any], field: str, default: float) -> float:
    """A float field as the reference reads it: a finite number (the frontend sends 1, not 1.0)."""
    value = body.get(field, default)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]{1,9}(\.[0-9]{1,9})?\s*", value, re.ASCII):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1e9 < value < 1e9:
        raise RequestError(field, "must be a number")
    return float(value)


def _bad_text(body: dict[str, Any]) -> tuple[str, str] | None:
    """(field, why) for the first of the reference's text fields (prompt, tags, lyrics) that is neither a string
    nor null, or holds text the tokenizer cannot take, whichever of them this request uses (the reference's model
    types them all as strings; a list of tags, nested or not, is refused as the document says); else None."""
    for field in ("prompt", "tags", "lyrics"):
        value = body.get(field)
        if value is None:
            continue
        if not isinstance(value, str):
            return field, "must be a string (or null)"
        bad = untokenizable(value)
        if bad is not None:
            return field, bad
    return None


def _translate(body: dict[str, Any], longest_song: Callable[[dict[str, Any]], float]) -> dict[str, Any]:
    """The reference's fields → a native MusicRequest body. As the reference does: unknown fields are
    ignored, and numbers are clamped to its ranges (duration 1–10 minutes, top_k_bb 1–200, temperature
    0.6–1.4) rather than refused. Ten minutes is longer than the backbone can write (23,552 tokens, ~9.1
    min): the reference accepts it and its song stops at that cap; here it becomes the longest song this
    request's prompt leaves room for (`longest_song` of the native body)."""
    mode = body.get("mode", "vocal")
    prompt_mode = body.get("prompt_mode", "tags")
    if prompt_mode not in ("natural", "tags"):
        raise RequestError("prompt_mode", "must be 'natural' or 'tags'")
    minutes = max(1, min(10, _whole(body, "duration", 3)))
    top_k = max(1, min(200, _whole(body, "top_k_bb", 80)))
    temperature = max(0.6, min(1.4, _real(body, "temperature", 1.0)))
    text_field = "tags" if prompt_mode == "tags" else "prompt"
    native = {
        "mode": mode,
        text_field: body.get(text_field, ""),
        "duration_s": float(minutes * 60),
        "num_tracks": NUM_TRACKS,
        "temperature": temperature,
        "top_k": top_k,
    }
    if mode == "vocal":
        native["lyrics"] = body.get("lyrics", "")
    native["duration_s"] = max(1.0, min(native["duration_s"], longest_song(native)))
    return native


def _phase(track: dict[str, Any], progress: int, no_live_worker: bool = False) -> tuple[str, str, str]:
    """(status, worker_phase, phase_display) of one track, in the reference's words; an open track whose
    worker is offline, or whose job no live worker serves (`no_live_worker`: the record's `worker_offline`),
    says so instead of freezing on its last progress."""
    state, detail = track["state"], track["detail"] or ""
    status = TRACK_STATUS.get(state, "error")
    status_phase = _running_phase(track, state, detail.startswith(LOADING), progress)
    if status_phase is None:
        if state == QUEUED and no_live_worker:
            return status, "idle", "Queued · no worker is online: it starts when one is back"
        return status, "idle", {QUEUED: "Queued", DONE: "Done"}.get(state, "Error")
    worker_phase, display = status_phase
    if track.get("worker_status") == "offline":
        display = f"Worker {track['worker']} offline · {track['stage']} resumes when the track moves or it returns"
    elif no_live_worker:
        display = f"No worker is online · {track['stage']} resumes when one is back"
    return status, worker_phase, display


def _running_phase(track: dict[str, Any], state: str, loading: bool, progress: int) -> tuple[str, str] | None:
    """The phase of a running track; "Loading ..." only while its stage reports a model load (a detail starting
    `LOADING`), never merely because the stage has just started."""
    if state == "backbone":
        return (
            ("loading_backbone", "Loading backbone model...")
            if loading
            else ("backbone", _backbone_display(track, progress))
        )
    if state == "superres":
        return (
            ("loading_superres", "Loading super-resolution model...")
            if loading
            else ("superres", f"Super-Resolution Generating · {progress}%")
        )
    if state in ("decoding", "exporting"):
        return (
            ("loading_decoder", "Loading decoder model...")
            if loading and state == "decoding"
            else ("decoding", "Decoding audio...")
        )
    return None


def _backbone_display(track: dict[str, Any], progress: int) -> str:
    """With the rate the backbone measured over its own run (in its detail, once it means something), as the
    reference shows it; without one, the percentage alone (never a rate guessed from a stage start that a
    restart or a batch adoption left behind)."""
    match = TOKENS.match(track["detail"] or "")
    if not match or match.group(3) is None:
        return f"Backbone generating · {progress}%"
    return f"Backbone generating · {progress}% · {match.group(3)} tok/s · {match.group(1)} tokens"


def overall_fraction(shares: list[float], index: int, within: float) -> float:
    """A track's progress over its whole chain: the shares of the stages before `index`, plus stage `index`'s
    share times its own progress `within` (0..1). Non-decreasing as `within` grows and as `index` moves on (a
    finished stage counts its whole share, which is what the next stage starts from)."""
    within = min(max(within, 0.0), 1.0)
    return min(1.0, sum(shares[:index]) + (shares[index] * within if index < len(shares) else 0.0))


def _progress(track: dict[str, Any]) -> int:
    """The track's one percentage over all its stages (overall_fraction with STAGE_SHARES): held within 1-99
    while a stage runs, as the reference holds it; 100 done; 0 failed or canceled (as the reference); a queued
    track shows the stages it has already finished (after a restart or a retry it resumes there), so its
    figure does not fall back to 0 between stages or while it waits to resume."""
    state = track["state"]
    if state == DONE:
        return 100
    if state in (FAILED, CANCELED):
        return 0
    names = [stage.name for stage in MUSIC.stages]
    shares = [STAGE_SHARES[name] for name in names]
    if track["stage"] not in names:  # queued (or parked): where it will resume
        return _percent(overall_fraction(shares, first_unfinished(MUSIC, track["stages"] or {}), 0.0))
    percent = _percent(overall_fraction(shares, names.index(track["stage"]), float(track["progress"] or 0)))
    return max(1, min(99, percent))


def _percent(fraction: float) -> int:
    """Whole percent, rounded down (a figure never claims more than is done); the epsilon keeps a sum of
    shares such as 0.75 + 0.17 = 0.9199999... at its 92."""
    return int(100 * fraction + 1e-9)


def _job_status(statuses: list[str]) -> str:
    if all(s == "queued" for s in statuses):
        return "queued"
    if all(s in ("done", "error") for s in statuses):
        return "completed" if all(s == "done" for s in statuses) else "partial"
    if any(s not in ("queued", "done", "error") for s in statuses):
        return "generating"
    return "pending"  # some tracks finished, the others still wait in the queue


def _song_seconds(track: dict[str, Any]) -> float:
    """The track's actual length (known once its backbone is done; the model may end a song early), 0 before,
    as the reference reports it."""
    song = track.get("song")
    return round(song["duration_s"], 1) if song else 0


def _failure(track: dict[str, Any]) -> str | None:
    """Why a track ended `error`, in the track's `error` field, where the reference backend puts a failed
    track's reason (its UI shows only an "Error" badge; a client that wants the reason reads this field). A
    canceled track ends `error` too (the reference has no cancel), so it says it was canceled rather than
    leave the field null; a track that has not ended has no failure: null."""
    if track["state"] == FAILED:
        return str(track["error"] or track["detail"] or "failed")
    if track["state"] == CANCELED:
        detail = str(track["detail"] or "")
        if "cancel" in detail:
            return detail
        return f"canceled: {detail}" if detail else "canceled"
    return None


def job_reply(record: dict[str, Any], worker_offline: bool = False) -> dict[str, Any]:
    """`worker_offline`: the record's flag (app/control/eta.job_readings): no live worker serves an open track."""
    tracks = []
    for track in record["tracks"]:
        progress = _progress(track)
        status, worker_phase, display = _phase(track, progress, worker_offline)
        tracks.append(
            {
                "index": track["track"],
                "status": status,
                "progress": progress,
                "phase_display": display,
                "worker_id": track["worker"] or None,
                "worker_phase": worker_phase,
                "duration_sec": _song_seconds(track),
                "error": _failure(track),
            }
        )
    statuses = [t["status"] for t in tracks]
    return {
        "job_id": record["job_id"],
        "status": _job_status(statuses),
        "queue_position": record["queue_position"] if all(s == "queued" for s in statuses) else 0,
        "cleaned_lyrics": record["params"].get("lyrics", ""),
        "created_at": datetime.fromtimestamp(record["created_at"], timezone.utc).isoformat(),
        "tracks": tracks,
    }


def _starts_now(svc: Services, record: dict[str, Any]) -> bool:
    """True when a worker takes the job at once: routed, and no other job's track is ahead on its queue."""
    first = record["tracks"][0]
    if not first["queue"]:
        return False
    ahead = decoded_members(
        svc.redis.zrange(svc.jobs.load_key(first["queue"]), 0, record["num_tracks"])
    )  # at most this many
    return len(ahead) <= record["num_tracks"] and all(m.startswith(record["job_id"] + ":") for m in ahead)


def status_reply(svc: Services, transport_options: dict[str, Any]) -> dict[str, Any]:
    """GPUs (live workers), idle ones, jobs being processed (a track started, not all ended) and jobs
    waiting (no track started yet), one Redis round trip whatever the number of jobs."""
    snapshot = take_snapshot(svc, transport_options, KHALA_STATUS_PARTS, job_states=("running", QUEUED))
    workers = [w for w in snapshot.workers if w.get("role") != "cpu"]  # a host's CPU-stage worker is no GPU
    live = [w for w in workers if w["status"] != "offline"]
    counts = snapshot.jobs
    return {
        "total_gpus": len(live),
        "idle_gpus": sum(w["status"] == "idle" for w in live),
        "active_jobs": sum(n for (_, state), n in counts.items() if state == "running"),
        "queued_jobs": sum(n for (_, state), n in counts.items() if state == QUEUED),
        "workers": [
            {
                "worker_id": w["name"],
                "status": w["status"],
                "phase": _worker_phase(w),
                "gpu_id": _gpu_index(w.get("queue", "") or w["name"]),
            }
            for w in workers
        ],
    }


def _worker_phase(worker: dict[str, Any]) -> str:
    current = worker.get("current")
    if not current:
        return "idle"
    return {"backbone": "backbone", "superres": "superres", "decode": "decoding", "export": "decoding"}.get(
        current["stage"], current["stage"]
    )


def _gpu_index(queue: str) -> int | None:
    digits = re.search(r"(\d+)", queue)
    return int(digits.group(1)) if digits else None


blueprint = Blueprint("khala", __name__)


def register(app: Flask, compat_prefix: str) -> None:
    """The contract's routes at ENCORE_COMPAT_PREFIX (none by default) and again under /api (once, when the
    prefix is /api), each mount under its own name (replies.KHALA_BLUEPRINTS)."""
    prefix_mount, api_mount = KHALA_BLUEPRINTS
    app.register_blueprint(blueprint, name=prefix_mount, url_prefix=compat_prefix or None)
    if compat_prefix != "/api":
        app.register_blueprint(blueprint, name=api_mount, url_prefix="/api")


def load_catalogue(tags_file: Path | None) -> dict[str, Any]:
    """The tag catalogue GET /tags serves: ENCORE_TAGS_FILE, or the reference's own (its four groups, labels
    and tag names, case kept: the frontend's default selection, "Mandopop", "Female Vocals"..., must be in
    it). Read as UTF-8 whatever the locale: the reference's group labels are bilingual ("流派/风格 (Genre/Style)").
    The catalogue only offers tags: as the reference, POST /generate takes any tags, listed or not."""
    catalogue: dict[str, Any] = json.loads((tags_file or DEFAULT_TAGS).read_text(encoding="utf-8"))
    return catalogue


@blueprint.get("/tags")
@documented("Khala: the tag catalogue the reference frontend offers", responses={200: ("groups of tags", TAGS_SCHEMA)})
def tags() -> ResponseReturnValue:
    """The tag catalogue the reference frontend offers."""
    return jsonify(context().tags)


@blueprint.get("/status")
@documented("Khala: GPUs, idle ones, active and queued jobs", responses={200: ("the status", KhalaStatus)})
def status() -> ResponseReturnValue:
    """GPUs (live workers), idle ones, active and queued jobs, per worker phase."""
    shared = context()
    return jsonify(status_reply(shared.services, shared.transport_options))


@blueprint.post("/generate")
@documented(
    "Khala: submit a 2-track song in the reference's format",
    json_body=KhalaGenerate,
    headers=IDEMPOTENCY_HEADER,
    responses={
        200: (
            ("accepted or queued (or, with an Idempotency-Key used before with this body, the job that request made)"),
            KhalaAccepted,
        ),
        400: "invalid field (named first in `error`)",
        403: forbidden_to_tenant("song", "duration_s"),
        409: "the Idempotency-Key was used with a different body",
        429: TOO_MANY,
    },
)
def generate() -> ResponseReturnValue:
    """Submit a 2-track song in the reference's format: translated into a native MusicRequest, validated and
    submitted as the native route does (once per Idempotency-Key)."""
    check_submit_rate()  # first: a refused submit is not read
    shared = context()
    try:
        body = json_object(request)
    except BodyError as exc:
        return _error(400, str(exc), exc.field)
    bad_text = _bad_text(body)
    if bad_text is not None:
        return _error(400, f"{bad_text[0]}: {bad_text[1]}", bad_text[0])
    try:
        req = validate_music(
            _translate(body, lambda native: longest_song(native, shared.profile)), shared.settings, shared.profile
        )
    except RequestError as exc:
        field = NATIVE_TO_CONTRACT_FIELD.get(exc.field, exc.field)
        if field == "tags" and body.get("prompt_mode") == "natural":
            field = "prompt"
        return _error(400, f"{field}: {exc.message}", field)
    job_id, _ = submit_once(
        shared,
        idempotency_key(),
        lambda: idempotency.json_digest(body),
        lambda new_id: submit_music(
            shared.services, shared.celery, req, shared.profile, job_id=new_id, tenant=tenant(), api="khala"
        ),
    )
    record = shared.services.jobs.existing_record(job_id)  # just written
    starts = _starts_now(shared.services, record)
    return jsonify(
        {
            "status": "accepted" if starts else "queued",
            "job_id": job_id,
            "num_tracks": NUM_TRACKS,
            # as the reference: a position only for a job that waits (0 for one a worker takes at once)
            "queue_position": 0 if starts else record["queue_position"],
        }
    )


@blueprint.get("/job/<job_id>")
@documented("Khala: a job in the reference's shape", responses={200: ("the job", KhalaJob), 404: "unknown job"})
def job(job_id: str) -> ResponseReturnValue:
    """A job in the reference's shape; both tracks are present from the first reply."""
    svc = context().services
    record = svc.jobs.record(job_id, viewer=tenant())
    if record is None or record["kind"] != "music":
        return _error(404, f"Job {job_id} not found.", "job_id")
    [(_, worker_offline)] = job_readings(svc, [record])
    return jsonify(job_reply(record, worker_offline))


@blueprint.get("/job/<job_id>/track/<int(signed=True):index>/<fmt>")
@documented(
    "Khala: a track as mp3 (inline, ranges honoured) or wav (attachment)",
    media=("audio/mpeg", "audio/wav"),
    responses={**DOWNLOAD_REPLIES, 400: "track index out of range", 404: "unknown job or format, or not ready"},
)
def track_file(job_id: str, index: int, fmt: str) -> ResponseReturnValue:
    """mp3 inline (ranges honoured) or wav as an attachment."""
    svc = context().services
    record = svc.jobs.record(job_id, viewer=tenant())
    if record is None or record["kind"] != "music":
        return _error(404, f"Job {job_id} not found.", "job_id")
    if fmt not in ("mp3", "wav"):
        return _error(404, "format: use mp3 or wav", "format")
    if not 0 <= index < record["num_tracks"]:
        return _error(400, f"track index {index} out of range (0..{record['num_tracks'] - 1})", "index")
    track, name = record["tracks"][index], f"track{index}.{fmt}"
    if track["state"] != DONE or name not in track["artifacts"]:
        return _error(404, f"Track {index} is not ready.", "index")
    path = svc.artifacts.local_path(job_id, name)
    download_name = f"encore_{job_id[:8]}_track{index}.{fmt}"
    if fmt == "mp3":
        return send_file(
            path, mimetype="audio/mpeg", conditional=True, as_attachment=False, download_name=download_name
        )
    return send_file(path, mimetype="audio/wav", conditional=True, as_attachment=True, download_name=download_name)
