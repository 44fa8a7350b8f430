"""Request and reply schemas (pydantic): one definition validates input and names the offending field, and
the OpenAPI document (app/http/openapi.py) is generated from these same models."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.json_schema import JsonDict

from app.pipeline.music.lyrics import clean_lyrics
from app.pipeline.music.positions import longest_song_for
from app.core.priority import DEFAULT_PRIORITY, Priority

MAX_SEED = 2**31 - 1
# Text the tokenizer takes, as the OpenAPI document says it (untokenizable() is the server's check; a lone
# surrogate, which it also refuses, has no JSON Schema spelling): no control character but tab and line breaks.
TEXT_PATTERN = r"^[^\u0000-\u0008\u000B\u000C\u000E-\u001F\u007F-\u009F]*$"
_ASCII_SPACE = r"[ \t\n\r\f\v]*"
# The Khala contract's lax numbers (app/http/khala.py _whole and _real), as its document says them.
WHOLE_NUMBER_SCHEMA: JsonDict = {
    "anyOf": [
        {"type": "integer"},
        {"type": "number", "multipleOf": 1},
        {"type": "string", "pattern": f"^{_ASCII_SPACE}[+-]?[0-9]{{1,9}}{_ASCII_SPACE}$"},
    ]
}
REAL_NUMBER_SCHEMA: JsonDict = {
    "anyOf": [
        {"type": "number", "exclusiveMinimum": -1e9, "exclusiveMaximum": 1e9},
        {"type": "string", "pattern": f"^{_ASCII_SPACE}[+-]?[0-9]{{1,9}}(\\.[0-9]{{1,9}})?{_ASCII_SPACE}$"},
    ]
}
TEXT_SCHEMA: JsonDict = {"anyOf": [{"type": "string", "pattern": TEXT_PATTERN}, {"type": "null"}]}
# A webhook URL as the submit-time check takes it (app/adapters/webhooks.parse_url and refusal, with no
# ENCORE_WEBHOOK_HOSTS): http(s), a DNS name (its last label not a number; not localhost), port 80 or 443, RFC 3986's
# characters. A name is resolved at delivery, where an address that is not public is refused. (The check also takes
# a public IP address, which this pattern leaves out.)
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_NOT_LOCALHOST = r"(?!([^/?#:]*\.)?[Ll][Oo][Cc][Aa][Ll][Hh][Oo][Ss][Tt]\.?([:/?#]|$))"  # loopback by RFC 6761
WEBHOOK_URL = (
    rf"[Hh][Tt][Tt][Pp][Ss]?://{_NOT_LOCALHOST}({_LABEL}\.)*[A-Za-z]([A-Za-z0-9-]{{0,61}}[A-Za-z0-9])?\.?"
    r"(:0*(80|443))?([/?#][A-Za-z0-9._~:/?#\[\]@!$&'()*+,;=%-]*)?"
)
WEBHOOK_EVENT = "(start|progress|completed|failed|canceled)"
NO_WEBHOOKS = "this server has no ENCORE_WEBHOOK_SECRET: it takes no webhook (a 400 names `webhook`)"


class MusicRequest(BaseModel):
    """POST /api/v1/music. Limits that depend on deployment (duration range, track count, text sizes)
    come from the validation context: {"min_duration_s", "max_duration_s", "max_tracks", ...}."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            # the two rules the fields alone cannot say: tags or a prompt; lyrics unless the song is instrumental
            "anyOf": [
                {"required": ["tags"], "properties": {"tags": {"type": "string", "pattern": r"\S"}}},
                {"required": ["prompt"], "properties": {"prompt": {"type": "string", "pattern": r"\S"}}},
            ],
            "if": {"required": ["mode"], "properties": {"mode": {"const": "instrumental"}}},
            "else": {"required": ["lyrics"], "properties": {"lyrics": {"type": "string", "pattern": r"\w"}}},
            # events to send need a URL to send them to
            "dependentSchemas": {
                "webhook_events": {
                    "if": {"properties": {"webhook_events": {"type": "array"}}},
                    "then": {"required": ["webhook"], "properties": {"webhook": {"type": "string"}}},
                }
            },
        },
    )

    mode: Literal["vocal", "instrumental"] = "vocal"
    tags: str | None = None
    prompt: str | None = Field(default=None, description="natural-language description of the song")
    lyrics: str | None = None
    duration_s: float | None = Field(
        default=None,
        description="song length in seconds; at most what the "
        "backbone's positions hold after this request's prompt (a 400 says how much)",
    )
    num_tracks: int = Field(default=2, ge=1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    temperature: float = Field(default=1.0, ge=0.6, le=1.4)
    top_k: int = Field(default=80, ge=1, le=200)
    webhook: str | None = Field(
        default=None,
        max_length=2000,
        description="an http(s) URL that receives the job's "
        "events, signed the Standard Webhooks way (docs/api.md: Webhooks)",
    )
    webhook_events: list[Literal["start", "progress", "completed", "failed", "canceled"]] | None = Field(
        default=None, min_length=1, description="which events to send (default: start, completed, failed, canceled)"
    )
    priority: Priority = Field(
        default=DEFAULT_PRIORITY,
        description="orders the first stages of jobs waiting for a "
        "GPU (high before normal before low, then by submission); a started job's later "
        "stages still run before any other job's first stage",
    )

    @field_validator("num_tracks", "seed", "top_k", mode="before")
    @classmethod
    def _whole_number(cls, value: Any) -> Any:
        """A whole number written with a fraction (315.0) is the integer it is: JSON Schema's `integer`, which the
        document says, takes it; anything else is left to the strict check (2.5, "3" and true are refused)."""
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    @field_validator("tags", "prompt", "lyrics")
    @classmethod
    def _strip(cls, value: str | None, info) -> str | None:
        if not isinstance(value, str):
            return value
        bad = untokenizable(value)
        if bad is not None:
            raise _field_error(info.field_name, bad)
        return value.strip()

    @model_validator(mode="after")
    def _deployment_limits(self, info) -> "MusicRequest":
        limits = info.context or {}
        max_text = limits.get("max_text_chars", 1000)
        for name in ("tags", "prompt"):
            value = getattr(self, name)
            if value and len(value) > max_text:
                raise _field_error(name, f"at most {max_text} characters")
        if not (self.tags or self.prompt):
            raise _field_error("tags", "give tags or a prompt describing the music")
        if self.lyrics and len(self.lyrics) > limits.get("max_lyrics_chars", 8000):
            raise _field_error("lyrics", f"at most {limits.get('max_lyrics_chars', 8000)} characters")
        if self.mode == "vocal":
            if not self.lyrics or not clean_lyrics(self.lyrics).strip():
                raise _field_error("lyrics", "required in vocal mode")
        low, high = limits.get("min_duration_s", 1.0), limits.get("max_duration_s", 600.0)
        if self.duration_s is None:
            self.duration_s = limits.get("default_duration_s", low)
        if not low <= self.duration_s <= high:
            raise _field_error("duration_s", f"must be between {low:g} and {high:g} seconds")
        profile = limits.get("profile")
        if profile is not None:
            longest = longest_song_for(
                profile, mode=self.mode, tags=self.tags, description=self.prompt, lyrics=self.lyrics
            )
            if self.duration_s > longest:
                raise _field_error(
                    "duration_s",
                    f"at most {longest:g} seconds with this prompt and lyrics (the "
                    f"model holds {profile.backbone.max_sequence_length} positions, prompt included)",
                )
        max_tracks = limits.get("max_tracks", 4)
        if self.num_tracks > max_tracks:
            raise _field_error("num_tracks", f"at most {max_tracks}")
        return self


def music_request_schema(limits: dict[str, Any]) -> dict[str, Any]:
    """MusicRequest's JSON Schema with this deployment's limits (the validation context) written in."""
    schema = MusicRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    fields = schema["properties"]
    duration = {"type": "number", "minimum": limits["min_duration_s"], "maximum": limits["max_duration_s"]}
    fields["duration_s"] = {**fields["duration_s"], "anyOf": [duration, {"type": "null"}]}
    fields["num_tracks"]["maximum"] = limits["max_tracks"]
    for name, limit in (("tags", "max_text_chars"), ("prompt", "max_text_chars"), ("lyrics", "max_lyrics_chars")):
        fields[name]["anyOf"][0]["maxLength"] = limits[limit]
        fields[name]["anyOf"][0]["pattern"] = TEXT_PATTERN
    if limits.get("webhooks"):
        fields["webhook"]["anyOf"][0]["pattern"] = f"^{WEBHOOK_URL}$"
    else:
        for name in ("webhook", "webhook_events"):
            fields[name] = {"type": "null", "description": NO_WEBHOOKS}
    return schema


def webhook_form_fields(takes_webhooks: bool) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The lip-sync form's webhook fields as this server takes them ({field: schema}), and the rule they make
    together (events only with a URL); an empty field is an absent one (app/http/uploads.py)."""
    if not takes_webhooks:
        fields = {
            name: {"type": "string", "maxLength": 0, "description": NO_WEBHOOKS}
            for name in ("webhook", "webhook_events")
        }
        return fields, {}
    events = rf"\s*{WEBHOOK_EVENT}\s*(,\s*{WEBHOOK_EVENT}\s*)*"
    fields = {
        "webhook": {"type": "string", "maxLength": 2000, "pattern": f"^({WEBHOOK_URL})?$"},
        "webhook_events": {"type": "string", "maxLength": 100, "pattern": f"^({events})?$"},
    }
    without_url = {"anyOf": [{"not": {"required": ["webhook"]}}, {"properties": {"webhook": {"maxLength": 0}}}]}
    return fields, {"if": without_url, "then": {"properties": {"webhook_events": {"maxLength": 0}}}}


def untokenizable(text: str) -> str | None:
    """Why the tokenizer could not take `text` (a lone surrogate, which has no UTF-8 form; a control
    character other than tab and line breaks), or None."""
    for position, char in enumerate(text):
        code = ord(char)
        if 0xD800 <= code <= 0xDFFF:
            return f"contains a lone surrogate U+{code:04X} at position {position} (not valid Unicode text)"
        if (code < 0x20 and char not in "\t\n\r") or 0x7F <= code < 0xA0:
            return f"contains the control character U+{code:04X} at position {position}"
    return None


class FieldError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _field_error(field: str, message: str) -> FieldError:
    return FieldError(field, message)


def describe_validation_error(error: ValidationError) -> tuple[str, str]:
    """(field, message) for the first problem, in words a client can act on."""
    first = error.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return cause.field, cause.message
    field = ".".join(str(part) for part in first["loc"]) or "body"
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    return field, message


class Accepted(BaseModel):
    """202 reply to a submission."""

    job_id: str
    status_url: str
    queue_position: int
    state: str
    eta_s: float | None = Field(
        default=None,
        description="estimated seconds until the job is done, the work queued "
        "ahead of it included, from each GPU queue's learned stage rates; 0 once it ended, "
        "null while a track waits for a live worker",
    )
    note: str | None = None


class ErrorReply(BaseModel):
    """Every 4xx/5xx body: a message that names the field when one is at fault; the Khala-compatible routes
    add "status": "error" (its frontend checks that field)."""

    error: str
    field: str | None = None
    status: Literal["error"] | None = None


# ---- replies (the OpenAPI document's response schemas; app/http/openapi.py)


class _Open(BaseModel):
    """A reply that may grow fields: clients must ignore the ones they do not know."""

    model_config = ConfigDict(extra="allow")


class TrackReply(_Open):
    track: int
    state: str = Field(description="queued, running, done, failed or canceled")
    status: str = Field(description="the lifecycle status: created, parked, queued, running:<stage>, ...")
    stage: str
    stages: dict[str, Any]
    progress: float
    queue: str
    worker: str
    detail: str | None = None
    error: str
    artifacts: list[str]
    downloads: dict[str, str]
    queue_position: int | None = None
    restarts: int
    retries: int = Field(default=0, description="times a client re-ran the track (POST /api/v1/jobs/<id>/retry)")
    attempts: int
    version: int
    updated_at: float | None = None
    seed: int | None = None


class JobReply(_Open):
    job_id: str
    kind: Literal["music", "lipsync"]
    state: str = Field(description="queued, running, done, partial, failed or canceled")
    params: dict[str, Any]
    num_tracks: int
    created_at: float
    expires_at: float
    queue_position: int
    cancel_requested: bool
    tracks: list[TrackReply]
    eta_s: float | None = Field(
        default=None,
        description="estimated seconds until the job is done, the work queued "
        "ahead of it included, from each GPU queue's learned stage rates; 0 once it ended, "
        "null while a track waits for a live worker",
    )
    worker_offline: bool = Field(
        default=False,
        description="true while an open track's queue has had no live worker for a few heartbeats: nothing runs "
        "it until one is back (it resumes then; its `eta_s` is null meanwhile)",
    )


class RetryReply(JobReply):
    retried: list[int] = Field(description="the tracks queued again")


class JobList(BaseModel):
    jobs: list[JobReply]


class WorkerReply(_Open):
    name: str
    status: str = Field(description="idle, busy or offline")


class StatusReply(BaseModel):
    workers: list[WorkerReply]
    queues: list[dict[str, Any]]
    unrouted: int
    time: float


class TenantUsage(BaseModel):
    tenant: str
    jobs: int = Field(description="jobs submitted")
    tracks: int = Field(description="tracks submitted")
    gpu_seconds: float = Field(description="wall seconds its stages ran on GPU queues")
    open_tracks: int = Field(description="its tracks not ended now")


class UsageReply(BaseModel):
    tenants: list[TenantUsage]


class DrainReply(BaseModel):
    queue: str
    draining: bool
    moved: int | None = None


class HealthReply(BaseModel):
    web: str
    redis: str


class WorkerReadiness(BaseModel):
    name: str
    kinds: list[str] = Field(description="the job kinds the worker serves")
    models_loaded: list[str] = Field(description="the kinds whose models its pool child has loaded")
    ready: bool
    missing: list[str]


class ReadyReply(BaseModel):
    """GET /readyz: Redis answers and a live worker has the models of every kind it serves loaded."""

    ready: bool
    redis: str
    workers: list[WorkerReadiness]
    error: str | None = None


class KhalaGenerate(_Open):
    """POST /generate as the reference takes it: unknown fields are ignored, numbers are clamped to its
    ranges, whole numbers may come as 3, 3.0 or "3"; lyrics are required for a vocal song, and the prompt
    (prompt_mode natural) or the tags (prompt_mode tags) must not be empty."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "allOf": [
                {
                    "if": {"required": ["prompt_mode"], "properties": {"prompt_mode": {"const": "natural"}}},
                    "then": {"required": ["prompt"], "properties": {"prompt": {"type": "string", "pattern": r"\S"}}},
                    "else": {"required": ["tags"], "properties": {"tags": {"type": "string", "pattern": r"\S"}}},
                },
                {
                    "if": {"required": ["mode"], "properties": {"mode": {"const": "instrumental"}}},
                    "else": {"required": ["lyrics"], "properties": {"lyrics": {"type": "string", "pattern": r"\w"}}},
                },
            ]
        },
    )

    mode: Literal["vocal", "instrumental"] = "vocal"
    prompt_mode: Literal["natural", "tags"] = "tags"
    prompt: str | None = Field(default=None, json_schema_extra=TEXT_SCHEMA)
    tags: str | None = Field(default=None, json_schema_extra=TEXT_SCHEMA)
    lyrics: str | None = Field(default=None, json_schema_extra=TEXT_SCHEMA)
    duration: int | float | str = Field(
        default=3, description="minutes, clamped to 1..10", json_schema_extra=WHOLE_NUMBER_SCHEMA
    )
    top_k_bb: int | float | str = Field(
        default=80, description="clamped to 1..200", json_schema_extra=WHOLE_NUMBER_SCHEMA
    )
    temperature: float | str = Field(
        default=1.0, description="clamped to 0.6..1.4", json_schema_extra=REAL_NUMBER_SCHEMA
    )


class KhalaAccepted(BaseModel):
    status: Literal["accepted", "queued"]
    job_id: str
    num_tracks: int
    queue_position: int


class KhalaTrack(BaseModel):
    index: int
    status: str
    progress: int
    phase_display: str
    worker_id: str | None
    worker_phase: str
    duration_sec: int
    error: str | None


class KhalaJob(BaseModel):
    job_id: str
    status: str
    queue_position: int
    cleaned_lyrics: str
    created_at: str
    tracks: list[KhalaTrack]


class KhalaWorker(BaseModel):
    worker_id: str
    status: str
    phase: str
    gpu_id: int | None


class KhalaStatus(BaseModel):
    total_gpus: int
    idle_gpus: int
    active_jobs: int
    queued_jobs: int
    workers: list[KhalaWorker]
