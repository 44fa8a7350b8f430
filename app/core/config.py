"""Every setting Encore reads, in one place, from environment variables (docs/configuration.md's table is
printed from this module by scripts/config_table.py).

Settings are read when `load_settings()` is called, so tests and the demo can set the environment first.
"""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from app.core.tenants import PRIORITY_LEVELS, TenantDirectory, check_rate, tenant_directory
from app.pipeline.lipsync.options import LIPSYNC_MASKS, LIPSYNC_PATHS, LIPSYNC_PRECISIONS  # the pipeline's own

if TYPE_CHECKING:
    from app.pipeline.profiles import MusicProfile


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _int(name: str, default: str) -> int:
    """An integer setting; a value that is not one names its variable (int() alone would not say which)."""
    text = _env(name, default)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, not {text!r}") from None


def _float(name: str, default: str) -> float:
    """A finite number: "nan" and "inf" parse as floats but pass every bound check, so they are refused here."""
    text = _env(name, default)
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, not {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, not {text!r}")
    return value


def _time_limits(spec: str) -> dict[str, tuple[float | None, float]]:
    """Parse "backbone=1500/1800,decode=/600" into {stage: (soft, hard)}; an empty soft means none."""
    limits: dict[str, tuple[float | None, float]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        stage, _, pair = item.partition("=")
        soft, _, hard = pair.partition("/")
        limits[stage.strip()] = (float(soft) if soft.strip() else None, float(hard))
    return limits


MODEL_PATH_VARIABLES = {
    "tokenizer_subdir": "ENCORE_TOKENIZER_DIR",
    "backbone_subdir": "ENCORE_BACKBONE_DIR",
    "superres_subdir": "ENCORE_SUPERRES_DIR",
    "codec_file": "ENCORE_CODEC_FILE",
}

DEFAULT_WEB_URL = "http://127.0.0.1:8000"

RATE_LIMIT_STRATEGIES = ("fixed-window", "moving-window", "sliding-window-counter")  # limits' names

DEFAULT_TIME_LIMITS = (
    "backbone=1500/1560,superres=900/960,decode=900/960,export=300/330,prepare=300/330,lipsync=1500/1560,mux=300/330"
)


def _sentinels(text: str) -> tuple[tuple[str, int], ...]:
    """REDIS_SENTINELS "host:port,host:port" as (host, port) pairs (port 26379 when left out)."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "26379")
        if not host or not port.isdigit():
            raise ValueError(f"REDIS_SENTINELS: {item!r} is not host:port")
        pairs.append((host, int(port)))
    return tuple(pairs)


def _api_tokens(text: str, variable: str = "API_TOKEN") -> tuple[str, ...]:
    """API_TOKEN "tok,tok2" (or ENCORE_ADMIN_TOKENS): unset or empty means none, but a value that is set and holds
    an empty entry (",", " ", "a,,b") or a token with white space in it is refused: it must never turn
    authentication off, or drop a token, without a word."""
    if text == "":
        return ()
    tokens = tuple(part.strip(" \t") for part in text.split(","))  # str.strip() would also eat 0x85 and 0xA0
    for number, token in enumerate(tokens, 1):
        if not token:
            raise ValueError(f"{variable}: entry {number} of {len(tokens)} is empty (unset {variable} for no tokens)")
        if any(c.isspace() for c in token):
            raise ValueError(f"{variable}: entry {number} holds white space, which a bearer token cannot carry")
        if not token.isascii() or not token.isprintable():
            raise ValueError(
                f"{variable}: entry {number} holds a character that is not printable ASCII, which a "
                "bearer token sent in an HTTP header cannot carry the same way to every server"
            )
    return tokens


DEFAULT_SUBMIT_RATE_LIMIT = "300/minute"  # per tenant (per address where no token is configured): a batch of jobs
# passes, a flood does not (and ENCORE_TENANT_MAX_OPEN_TRACKS bounds what a tenant has open at once)


def _rate_limit(text: str) -> str:
    """ENCORE_SUBMIT_RATE_LIMIT: a rate (checked in Settings), or `off` for none; empty is refused, so that no typo
    turns the limit off."""
    text = text.strip()
    if not text:
        raise ValueError("ENCORE_SUBMIT_RATE_LIMIT is empty: give a rate such as 10/minute, or `off` for none")
    if text.lower() == "off" and text != "off":
        raise ValueError(f"ENCORE_SUBMIT_RATE_LIMIT: {text!r}: write `off` (lower case) for no limit")
    return "" if text == "off" else text


# Every numeric setting's bounds: (least, whether the least itself is allowed, most or None). Zero is allowed only
# where it means something (documented as "0: ..."); tests/test_settings.py checks that every numeric field of
# Settings is here, so a new one cannot skip its check.
NUMERIC_BOUNDS: dict[str, tuple[float, bool, float | None]] = {
    "job_ttl_s": (1, True, None),
    "s3_presign_s": (0, True, 7 * 24 * 3600),  # 0: downloads streamed; S3 presigns for at most a week
    "song_margin_s": (0, True, None),
    "batch_tracks": (1, True, None),
    "backbone_slots": (0, True, 256),  # 0: sized from free memory
    "torch_threads": (0, True, None),  # 0: torch's default
    "max_tracks": (1, True, None),
    "max_lyrics_chars": (1, True, None),
    "max_text_chars": (1, True, None),
    "max_deliveries": (1, True, None),
    "max_retries": (0, True, None),  # 0: no retries
    "cancel_grace_s": (0, True, None),  # 0: kill at once
    "reroute_after_s": (0, True, None),  # 0: never
    "lease_s": (1, True, None),
    "stall_after_s": (0, False, None),
    "heartbeat_s": (0, False, None),
    "result_expires_s": (1, True, None),
    "max_video_mb": (0, False, None),
    "max_audio_mb": (0, False, None),
    "min_video_s": (0, True, None),
    "max_audio_s": (0, False, None),
    "min_audio_s": (0, True, None),
    "max_video_pixels": (1, True, None),
    "max_video_s": (0, False, None),
    "max_video_frame_pixels": (1, True, None),
    "max_scratch_mb": (1, True, None),
    "ffmpeg_timeout_s": (0, False, None),
    "face_threads": (0, True, None),  # 0: one per core
    "lipsync_cache_mb": (0, True, None),  # 0: off
    "flower_port": (1, True, 65535),
    "web_workers": (1, True, None),
    "web_threads": (1, True, None),
    "body_idle_s": (0, False, None),
    "sse_heartbeat_s": (0, False, None),
    "sse_max_s": (0, False, None),
    "events_maxlen": (1, True, None),
    "max_streams_per_tenant": (1, True, None),
    "webhook_max_attempts": (1, True, None),
    "webhook_backoff_s": (0, False, None),
    "webhook_backoff_cap_s": (0, False, None),
    "webhook_timeout_s": (0, False, None),
    "webhook_history": (1, True, None),
    "webhook_progress_s": (0, True, None),  # 0: no least gap
    "max_queued_tracks": (0, True, None),  # 0: no cap
    "tenant_max_open_tracks": (0, True, None),  # 0: no cap
    "max_queued_tracks_per_queue": (0, True, None),  # 0: no cap
    "eta_alpha": (0, False, 1),
}


def webhook_entry(entry: str, setting: str) -> tuple[str, int | None]:
    """One ENCORE_WEBHOOK_HOSTS or ENCORE_WEBHOOK_ALLOW_PRIVATE entry as (host or network, port or None): "name",
    "name:8443", "10.0.0.0/8", "127.0.0.1:8080", "::1", "[::1]:8080" (an IPv6 entry with a port is bracketed).
    Read here, at start, so that a typo stops the service instead of refusing every webhook later."""
    if entry.startswith("["):
        host, closed, rest = entry[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError(f"{setting}: {entry!r} is not [address] or [address]:port")
        port_text = rest[1:] if rest else None
    elif entry.count(":") == 1:
        host, port_text = entry.split(":")
    else:
        host, port_text = entry, None
    if not host or (port_text is not None and not (port_text.isdigit() and 0 < int(port_text) < 65536)):
        raise ValueError(f"{setting}: {entry!r} is not host or host:port (a port from 1 to 65535)")
    return host, None if port_text is None else int(port_text)


def webhook_network(entry: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int | None]:
    """An ENCORE_WEBHOOK_ALLOW_PRIVATE entry as (network, port or None); host bits set are refused (a typo)."""
    host, port = webhook_entry(entry, "ENCORE_WEBHOOK_ALLOW_PRIVATE")
    try:
        return ipaddress.ip_network(host), port
    except ValueError as exc:
        raise ValueError(f"ENCORE_WEBHOOK_ALLOW_PRIVATE: {entry!r} is not an address or network: {exc}") from None


@dataclass(frozen=True)
class Settings:
    redis_url: str = field(default_factory=lambda: _env("REDIS_URL", "redis://127.0.0.1:6379/0"), repr=False)
    # Redis Sentinel (app/adapters/redis_conn.py): "host:port,host:port,..." of the sentinels and the monitored primary's
    # name; then REDIS_URL only gives the database and the primary's password. Sentinels' own password apart.
    redis_sentinels: tuple[tuple[str, int], ...] = field(
        default_factory=lambda: _sentinels(_env("REDIS_SENTINELS", ""))
    )
    redis_sentinel_master: str = field(default_factory=lambda: _env("REDIS_SENTINEL_MASTER", "mymaster"))
    redis_sentinel_password: str = field(default_factory=lambda: _env("REDIS_SENTINEL_PASSWORD", ""), repr=False)
    key_prefix: str = field(default_factory=lambda: _env("ENCORE_KEY_PREFIX", "encore"))
    job_ttl_s: int = field(default_factory=lambda: _int("ENCORE_JOB_TTL_S", str(24 * 3600)))
    artifact_backend: str = field(default_factory=lambda: _env("ENCORE_ARTIFACT_BACKEND", "dir"))
    artifact_dir: Path = field(default_factory=lambda: Path(_env("ENCORE_ARTIFACT_DIR", "var/artifacts")).resolve())
    # The s3 backend (app/adapters/artifacts.py S3Store): endpoint (empty: AWS), bucket, key prefix, region; credentials as
    # the standard AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (below). ENCORE_S3_PRESIGN=1 answers downloads with
    # a redirect to a URL presigned for ENCORE_S3_PRESIGN_S seconds instead of streaming them through the web.
    s3_endpoint: str = field(default_factory=lambda: _env("ENCORE_S3_ENDPOINT", ""))
    s3_bucket: str = field(default_factory=lambda: _env("ENCORE_S3_BUCKET", "encore"))
    s3_prefix: str = field(default_factory=lambda: _env("ENCORE_S3_PREFIX", "artifacts/"))
    s3_region: str = field(default_factory=lambda: _env("ENCORE_S3_REGION", "us-east-1"))
    # The standard variables, read with the other settings (so a test's or a host's environment is taken once);
    # unset: boto3's own chain (a profile, an instance role).
    s3_access_key: str = field(default_factory=lambda: _env("AWS_ACCESS_KEY_ID", ""), repr=False)
    s3_secret_key: str = field(default_factory=lambda: _env("AWS_SECRET_ACCESS_KEY", ""), repr=False)
    s3_presign_s: int = field(
        default_factory=lambda: _int("ENCORE_S3_PRESIGN_S", "900") if _env("ENCORE_S3_PRESIGN", "0") == "1" else 0
    )
    worker_cache_dir: Path = field(
        default_factory=lambda: Path(_env("ENCORE_WORKER_CACHE_DIR", "var/worker-cache")).resolve()
    )
    music_profile: str = field(default_factory=lambda: _env("ENCORE_MUSIC_PROFILE", "tiny"))
    model_dir: str | None = field(default_factory=lambda: os.environ.get("ENCORE_MODEL_DIR"))
    # Each model's location, overriding the profile's layout under ENCORE_MODEL_DIR (absolute, or relative to it).
    model_paths: dict[str, str] = field(
        default_factory=lambda: {
            name: os.environ[variable] for name, variable in MODEL_PATH_VARIABLES.items() if os.environ.get(variable)
        }
    )
    song_end: str | None = field(default_factory=lambda: os.environ.get("ENCORE_SONG_END") or None)
    song_margin_s: float = field(default_factory=lambda: _float("ENCORE_SONG_MARGIN_S", "90"))
    runtime_mode: str = field(default_factory=lambda: _env("ENCORE_RUNTIME_MODE", "keep_loaded"))
    batch_tracks: int = field(default_factory=lambda: _int("ENCORE_BATCH_TRACKS", "2"))
    backbone_slots: int = field(default_factory=lambda: _int("ENCORE_BACKBONE_SLOTS", "0"))
    engine_matmul: str = field(default_factory=lambda: _env("ENCORE_ENGINE_MATMUL", "exact"))
    music_engine: str = field(default_factory=lambda: _env("ENCORE_MUSIC_ENGINE", "torch"))
    preload_models: bool = field(default_factory=lambda: _env("ENCORE_PRELOAD", "0") == "1")
    torch_threads: int = field(default_factory=lambda: _int("ENCORE_TORCH_THREADS", "0"))
    max_tracks: int = field(default_factory=lambda: _int("ENCORE_MAX_TRACKS", "4"))
    max_lyrics_chars: int = field(default_factory=lambda: _int("ENCORE_MAX_LYRICS_CHARS", "8000"))
    max_text_chars: int = field(default_factory=lambda: _int("ENCORE_MAX_TEXT_CHARS", "1000"))
    time_limits: dict[str, tuple[float | None, float]] = field(
        default_factory=lambda: {**_time_limits(DEFAULT_TIME_LIMITS), **_time_limits(_env("ENCORE_TIME_LIMITS", ""))}
    )
    max_deliveries: int = field(default_factory=lambda: _int("ENCORE_MAX_DELIVERIES", "3"))
    # How often a client may retry one track (POST /api/v1/jobs/<id>/retry): each retry costs GPU time again.
    max_retries: int = field(default_factory=lambda: _int("ENCORE_MAX_RETRIES", "5"))
    cancel_grace_s: float = field(default_factory=lambda: _float("ENCORE_CANCEL_GRACE_S", "3"))
    reroute_after_s: float = field(default_factory=lambda: _float("ENCORE_REROUTE_AFTER_S", "30"))
    lease_s: float = field(default_factory=lambda: _float("ENCORE_LEASE_S", "15"))
    # A track waiting this long for a message that is in no broker list and not delivered gets it again.
    stall_after_s: float = field(default_factory=lambda: _float("ENCORE_STALL_AFTER_S", "30"))
    heartbeat_s: float = field(default_factory=lambda: _float("ENCORE_HEARTBEAT_S", "2"))
    result_expires_s: int = field(default_factory=lambda: _int("ENCORE_RESULT_EXPIRES_S", str(24 * 3600)))
    lipsync_profile: str = field(default_factory=lambda: _env("ENCORE_LIPSYNC_PROFILE", "tiny"))
    lipsync_model_dir: str | None = field(default_factory=lambda: os.environ.get("ENCORE_LIPSYNC_MODEL_DIR"))
    # MuseTalk's dtype: auto (fp16 on CUDA, fp32 on CPU), fp16 or fp32 (fp16 on a CPU only where it runs).
    lipsync_precision: str = field(default_factory=lambda: _env("ENCORE_LIPSYNC_PRECISION", "auto").strip().lower())
    max_video_mb: float = field(default_factory=lambda: _float("ENCORE_MAX_VIDEO_MB", "100"))
    max_audio_mb: float = field(default_factory=lambda: _float("ENCORE_MAX_AUDIO_MB", "20"))
    min_video_s: float = field(default_factory=lambda: _float("ENCORE_MIN_VIDEO_S", "3"))
    max_audio_s: float = field(default_factory=lambda: _float("ENCORE_MAX_AUDIO_S", "600"))
    # The shortest driving audio a lip-sync job takes (never less than one output frame period).
    min_audio_s: float = field(default_factory=lambda: _float("ENCORE_MIN_AUDIO_S", "0.5"))
    # Width × height of the largest face video (4096×2160): a bigger one is refused from its probe, before its
    # frames are ever decoded.
    max_video_pixels: int = field(default_factory=lambda: _int("ENCORE_MAX_VIDEO_PIXELS", str(4096 * 2160)))
    # The face video's length and its decoding work (frames x pixels), counted from its packets, not its header.
    max_video_s: float = field(default_factory=lambda: _float("ENCORE_MAX_VIDEO_S", "300"))
    # A lip-sync job's decoded source frames in the worker's scratch (RGB, the frames its output shows).
    max_scratch_mb: float = field(default_factory=lambda: _float("ENCORE_MAX_SCRATCH_MB", "16384"))
    max_video_frame_pixels: int = field(
        default_factory=lambda: _int("ENCORE_MAX_VIDEO_FRAME_PIXELS", str(300 * 30 * 1920 * 1080))
    )
    upload_dir: Path = field(default_factory=lambda: Path(_env("ENCORE_UPLOAD_DIR", "var/uploads")).resolve())
    ffmpeg_timeout_s: float = field(default_factory=lambda: _float("ENCORE_FFMPEG_TIMEOUT_S", "600"))
    # The ffmpeg / ffprobe every media call runs (app/pipeline/media/ffmpeg.py), the music export's pydub too.
    ffmpeg: str = field(default_factory=lambda: _env("ENCORE_FFMPEG", "ffmpeg"))
    ffprobe: str = field(default_factory=lambda: _env("ENCORE_FFPROBE", "ffprobe"))
    # How lip-sync blends the re-drawn face: "jaw" (a mask drawn from the 68 landmarks, as MuseTalk's 'jaw'
    # parsing mode shapes it) or "rectangle" (the face box's lower half; also used when no landmarks exist).
    lipsync_mask: str = field(default_factory=lambda: _env("ENCORE_LIPSYNC_MASK", "jaw"))
    # Lip-sync's per-frame work beside the model: "device" (crops, resizes and the blend as tensor ops on the
    # model's device; only finished frames come back) or "reference" (OpenCV on the CPU, MuseTalk's own ops).
    lipsync_path: str = field(default_factory=lambda: _env("ENCORE_LIPSYNC_PATH", "device"))
    # Threads that find faces in the prepare stage (dlib and OpenCV release the GIL); 0: one per core, at most 8.
    face_threads: int = field(default_factory=lambda: _int("ENCORE_FACE_THREADS", "0"))
    # The per-source-video cache (face track and VAE latents of a face video, for the next job on the same
    # video) under ENCORE_WORKER_CACHE_DIR/lipsync-sources, at most this many MiB, least recently used out; 0: off.
    lipsync_cache_mb: float = field(default_factory=lambda: _float("ENCORE_LIPSYNC_CACHE_MB", "2048"))
    # A warm-up batch through MuseTalk when the worker preloads it (first-call kernel choices off the clock).
    lipsync_warmup: bool = field(default_factory=lambda: _env("ENCORE_LIPSYNC_WARMUP", "1") == "1")
    api_tokens: tuple[str, ...] = field(default_factory=lambda: _api_tokens(_env("API_TOKEN", "")), repr=False)
    # Tenants (app/core/tenants.py): admin tokens beside API_TOKEN's, and the operator's file of tenants.
    admin_tokens: tuple[str, ...] = field(
        default_factory=lambda: _api_tokens(_env("ENCORE_ADMIN_TOKENS", ""), "ENCORE_ADMIN_TOKENS"), repr=False
    )
    tenants_file: Path | None = field(
        default_factory=lambda: Path(_env("ENCORE_TENANTS_FILE", "")) if _env("ENCORE_TENANTS_FILE", "") else None
    )
    compat_prefix: str = field(default_factory=lambda: _env("ENCORE_COMPAT_PREFIX", "").rstrip("/"))
    tags_file: Path | None = field(
        default_factory=lambda: Path(os.environ["ENCORE_TAGS_FILE"]) if os.environ.get("ENCORE_TAGS_FILE") else None
    )
    # What the worker is pinned to (worker_entrypoint.sh sets it), shown in its registry entry; never read to
    # pick a device: CUDA itself honours it.
    cuda_visible_devices: str = field(default_factory=lambda: _env("CUDA_VISIBLE_DEVICES", ""))
    # Flower (flowerconfig.py): basic-auth "user:password[,…]" (empty: one is generated), bind, state file.
    flower_basic_auth: str = field(default_factory=lambda: _env("ENCORE_FLOWER_BASIC_AUTH", "").strip(), repr=False)
    flower_port: int = field(default_factory=lambda: _int("ENCORE_FLOWER_PORT", "5555"))
    flower_address: str = field(default_factory=lambda: _env("ENCORE_FLOWER_ADDRESS", "0.0.0.0"))
    flower_db: str = field(default_factory=lambda: _env("ENCORE_FLOWER_DB", "var/flower.db"))
    # The HTTP clients (app/clients/cli.py, app/clients/demo.py): the server they talk to and the bearer token they send.
    client_url: str = field(default_factory=lambda: _env("ENCORE_URL", DEFAULT_WEB_URL))
    client_token: str | None = field(default_factory=lambda: os.environ.get("ENCORE_API_TOKEN") or None)
    demo_web_url: str = field(default_factory=lambda: _env("ENCORE_WEB_URL", DEFAULT_WEB_URL))
    # The web server (gunicorn.conf.py): where it listens, processes × threads, and how long a request body may
    # send nothing before the client is answered 408 and dropped.
    web_bind: str = field(default_factory=lambda: _env("ENCORE_WEB_BIND", "0.0.0.0:8000"))
    web_workers: int = field(default_factory=lambda: _int("ENCORE_WEB_WORKERS", "2"))
    web_threads: int = field(default_factory=lambda: _int("ENCORE_WEB_THREADS", "32"))
    body_idle_s: float = field(default_factory=lambda: _float("ENCORE_BODY_IDLE_S", "30"))
    # Server-sent events (GET /api/v1/jobs/<id>/events): a comment this often (the events server notices a gone
    # client at its failed write; the web, by a look at the connection about every second), and the longest one stream holds its gthread thread before it ends (the client resumes with
    # Last-Event-ID); the job's stream keeps its newest ENCORE_EVENTS_MAXLEN events for replay.
    sse_heartbeat_s: float = field(default_factory=lambda: _float("ENCORE_SSE_HEARTBEAT_S", "15"))
    sse_max_s: float = field(default_factory=lambda: _float("ENCORE_SSE_MAX_S", "3600"))
    events_maxlen: int = field(default_factory=lambda: _int("ENCORE_EVENTS_MAXLEN", "1000"))
    # The events server (app/http/events_server.py, `python -m app events`): event streams on one asyncio loop, where
    # an open stream costs no thread. Where it listens; its public base URL, which turns the web's stream route into
    # a 307 there (unset: the web serves streams itself, at most half its threads per process); and the most streams
    # one tenant may hold open at once on the events servers (429 past it).
    events_bind: str = field(default_factory=lambda: _env("ENCORE_EVENTS_BIND", "0.0.0.0:8001"))
    events_url: str = field(default_factory=lambda: _env("ENCORE_EVENTS_URL", "").strip().rstrip("/"))
    max_streams_per_tenant: int = field(default_factory=lambda: _int("ENCORE_MAX_STREAMS_PER_TENANT", "100"))
    # Webhooks (app/adapters/webhooks.py): the signing secret ("whsec_" + base64, Standard Webhooks; none: submits with a
    # webhook are refused), the hosts a webhook may name (comma list; ".example.com" takes its subdomains; empty:
    # any; "host:8443" also allows that port), the non-public addresses it may reach (comma list of addresses or
    # networks, "127.0.0.1:8080" for one port of one; empty: none), the queue of the webhook worker, attempts and
    # their backoff, the request timeout, how many attempts a job keeps, and the least seconds between a job's
    # progress webhooks.
    webhook_secret: str = field(default_factory=lambda: _env("ENCORE_WEBHOOK_SECRET", ""), repr=False)
    webhook_hosts: tuple[str, ...] = field(
        default_factory=lambda: tuple(
            h.strip().lower() for h in _env("ENCORE_WEBHOOK_HOSTS", "").split(",") if h.strip()
        )
    )
    webhook_allow_private: tuple[str, ...] = field(
        default_factory=lambda: tuple(
            h.strip().lower() for h in _env("ENCORE_WEBHOOK_ALLOW_PRIVATE", "").split(",") if h.strip()
        )
    )
    webhook_queue: str = field(default_factory=lambda: _env("ENCORE_WEBHOOK_QUEUE", "webhooks"))
    webhook_max_attempts: int = field(default_factory=lambda: _int("ENCORE_WEBHOOK_MAX_ATTEMPTS", "8"))
    webhook_backoff_s: float = field(default_factory=lambda: _float("ENCORE_WEBHOOK_BACKOFF_S", "1"))
    webhook_backoff_cap_s: float = field(default_factory=lambda: _float("ENCORE_WEBHOOK_BACKOFF_CAP_S", "300"))
    webhook_timeout_s: float = field(default_factory=lambda: _float("ENCORE_WEBHOOK_TIMEOUT_S", "10"))
    webhook_history: int = field(default_factory=lambda: _int("ENCORE_WEBHOOK_HISTORY", "50"))
    webhook_progress_s: float = field(default_factory=lambda: _float("ENCORE_WEBHOOK_PROGRESS_S", "5"))
    # Tracing (app/adapters/tracing.py): on when OpenTelemetry's standard OTEL_EXPORTER_OTLP_ENDPOINT is set (OTLP/HTTP);
    # spans carry the service name OTEL_SERVICE_NAME + "-web" / "-worker".
    otel_endpoint: str = field(default_factory=lambda: _env("OTEL_EXPORTER_OTLP_ENDPOINT", ""))
    otel_service_name: str = field(default_factory=lambda: _env("OTEL_SERVICE_NAME", "encore"))
    # Back-pressure (app/control/quotas.py): the most open (not ended) tracks in all, and on each live queue; a submit
    # that would pass either is refused 429 with a Retry-After from the ETA. 0: no cap.
    max_queued_tracks: int = field(default_factory=lambda: _int("ENCORE_MAX_QUEUED_TRACKS", "0"))
    max_queued_tracks_per_queue: int = field(default_factory=lambda: _int("ENCORE_MAX_QUEUED_TRACKS_PER_QUEUE", "0"))
    # Per-token rate limit of the submit routes (app/http/ratelimit.py), in Flask-Limiter's notation ("10/minute",
    # "5/second;100/hour"); empty: none. Its window strategy: fixed-window, moving-window or sliding-window-counter.
    submit_rate_limit: str = field(
        default_factory=lambda: _rate_limit(_env("ENCORE_SUBMIT_RATE_LIMIT", DEFAULT_SUBMIT_RATE_LIMIT))
    )
    # Per-tenant defaults (app/control/tenant_limits.py; a tenants file may set its own): open tracks at once
    # (0: no cap), and the highest priority a client tenant's jobs may ask for (admins may always use "high").
    tenant_max_open_tracks: int = field(default_factory=lambda: _int("ENCORE_TENANT_MAX_OPEN_TRACKS", "200"))
    tenant_max_priority: str = field(default_factory=lambda: _env("ENCORE_TENANT_MAX_PRIORITY", "normal"))
    rate_limit_strategy: str = field(default_factory=lambda: _env("ENCORE_RATE_LIMIT_STRATEGY", "fixed-window"))
    # ETA (app/control/eta.py): the weight of a finished stage's seconds in its queue's learned rate (exponential mean), the
    # one average the ETAs, routing and /metrics' encore_stage_seconds_per_unit read.
    eta_alpha: float = field(default_factory=lambda: _float("ENCORE_ETA_ALPHA", "0.3"))

    def __post_init__(self) -> None:
        self._check_bounds()
        self.tenants  # noqa: B018 (read now: a bad tenants file or token list refuses to start)
        if self.min_audio_s > self.max_audio_s:
            raise ValueError(
                f"ENCORE_MIN_AUDIO_S ({self.min_audio_s}) must not exceed ENCORE_MAX_AUDIO_S ({self.max_audio_s})"
            )
        if self.runtime_mode not in ("keep_loaded", "one_shot"):
            raise ValueError(f"ENCORE_RUNTIME_MODE must be keep_loaded or one_shot, not {self.runtime_mode!r}")
        if self.music_engine not in ("torch", "megatron"):
            raise ValueError(f"ENCORE_MUSIC_ENGINE must be torch or megatron, not {self.music_engine!r}")
        if self.engine_matmul not in ("exact", "batched"):
            raise ValueError(f"ENCORE_ENGINE_MATMUL must be exact or batched, not {self.engine_matmul!r}")
        if self.song_end not in (None, "model", "duration"):
            raise ValueError(f"ENCORE_SONG_END must be model or duration, not {self.song_end!r}")
        if self.lipsync_mask not in LIPSYNC_MASKS:
            raise ValueError(f"ENCORE_LIPSYNC_MASK must be jaw or rectangle, not {self.lipsync_mask!r}")
        if self.lipsync_path not in LIPSYNC_PATHS:
            raise ValueError(f"ENCORE_LIPSYNC_PATH must be device or reference, not {self.lipsync_path!r}")
        if self.artifact_backend not in ("dir", "redis", "s3"):
            raise ValueError(f"ENCORE_ARTIFACT_BACKEND must be dir, redis or s3, not {self.artifact_backend!r}")
        if self.webhook_queue.startswith("gpu"):
            raise ValueError(f"ENCORE_WEBHOOK_QUEUE must not be a GPU queue, not {self.webhook_queue!r}")
        for entry in self.webhook_hosts:
            webhook_entry(entry, "ENCORE_WEBHOOK_HOSTS")
        for entry in self.webhook_allow_private:
            webhook_network(entry)
        if self.webhook_secret:
            from standardwebhooks import Webhook
            from standardwebhooks.webhooks import EmptyWebhookSecretError

            try:
                Webhook(self.webhook_secret)
            except (ValueError, EmptyWebhookSecretError) as exc:  # binascii.Error is a ValueError
                raise ValueError(f"ENCORE_WEBHOOK_SECRET must be whsec_ + base64: {exc}") from None
        if self.events_url and not self.events_url.startswith(("http://", "https://")):
            raise ValueError(f"ENCORE_EVENTS_URL must be an http:// or https:// URL, not {self.events_url!r}")
        if self.rate_limit_strategy not in RATE_LIMIT_STRATEGIES:
            raise ValueError(
                f"ENCORE_RATE_LIMIT_STRATEGY must be one of {', '.join(RATE_LIMIT_STRATEGIES)}, "
                f"not {self.rate_limit_strategy!r}"
            )
        if self.submit_rate_limit:
            check_rate(self.submit_rate_limit, "ENCORE_SUBMIT_RATE_LIMIT")
        if self.tenant_max_priority not in PRIORITY_LEVELS:
            raise ValueError(
                f"ENCORE_TENANT_MAX_PRIORITY must be one of {', '.join(PRIORITY_LEVELS)}, not {self.tenant_max_priority!r}"
            )
        if self.lipsync_precision not in LIPSYNC_PRECISIONS:
            raise ValueError(f"ENCORE_LIPSYNC_PRECISION must be auto, fp16 or fp32, not {self.lipsync_precision!r}")

    def _check_bounds(self) -> None:
        """Every numeric setting against NUMERIC_BOUNDS: a value that makes no sense refuses to start."""
        for name, (least, least_allowed, most) in NUMERIC_BOUNDS.items():
            value = getattr(self, name)
            variable = f"ENCORE_{name.upper()}"
            if value < least or (value == least and not least_allowed):
                raise ValueError(f"{variable} must be {'>=' if least_allowed else '>'} {least:g}, not {value}")
            if most is not None and value > most:
                raise ValueError(f"{variable} must be <= {most:g}, not {value}")

    @cached_property
    def tenants(self) -> TenantDirectory:
        """Every token's tenant and role (app/core/tenants.py), from API_TOKEN, ENCORE_ADMIN_TOKENS and
        ENCORE_TENANTS_FILE."""
        return tenant_directory(self.api_tokens, self.admin_tokens, self.tenants_file)

    @property
    def authenticated(self) -> bool:
        """Whether requests must name a token (any token, admin or tenants file configured)."""
        return not self.tenants.open

    def music(self) -> "MusicProfile":
        """The music profile these settings select, with its files where the settings put them."""
        from app.pipeline.profiles import load_profile

        return load_profile(self.music_profile, self.model_dir, song_end=self.song_end, **self.model_paths)

    @property
    def longest_hard_limit_s(self) -> float:
        return max(hard for _, hard in self.time_limits.values())

    @property
    def visibility_timeout_s(self) -> int:
        """Above the longest hard limit, so a running stage is never re-delivered to a second worker."""
        return int(self.longest_hard_limit_s * 2 + 600)


# What each setting means, one line per Settings field: scripts/config_table.py prints docs/configuration.md's
# table from these, the variables and the defaults above, and tests/test_docs.py fails when the two differ.
SETTING_DESCRIPTIONS: dict[str, str] = {
    "redis_url": "broker, result backend, job records, registry; under Sentinel only the database and the "
    "primary's password",
    "redis_sentinels": "Redis through Sentinel (`app/adapters/redis_conn.py`): the sentinels as `host:port,host:port` "
    "(port 26379 when left out); empty: no Sentinel",
    "redis_sentinel_master": "the name of the primary the sentinels monitor",
    "redis_sentinel_password": "the sentinels' own password, when they require one",
    "key_prefix": "prefix of Encore's Redis keys",
    "job_ttl_s": "job records, their artifacts and Idempotency-Keys expire after this many seconds",
    "artifact_backend": "`dir` (shared directory), `redis` (chunked, expires with the job) or `s3` (an "
    "S3-compatible bucket)",
    "artifact_dir": "root of the `dir` backend (a shared volume across hosts)",
    "s3_endpoint": "the `s3` backend's endpoint (empty: AWS S3)",
    "s3_bucket": "the `s3` backend's bucket",
    "s3_prefix": "key prefix of the `s3` backend's objects (`<prefix><job id>/<name>`)",
    "s3_region": "the `s3` backend's region",
    "s3_access_key": "S3 credentials (the standard variable; unset: boto3's own chain, a profile or an instance role)",
    "s3_secret_key": "S3 credentials (the standard variable; unset: boto3's own chain)",
    "s3_presign_s": "with `ENCORE_S3_PRESIGN=1`, downloads are answered 302 to a URL presigned for "
    "`ENCORE_S3_PRESIGN_S` seconds instead of streamed through the web",
    "worker_cache_dir": "each host's local scratch: lip-sync track intermediates (`tracks/`: an ended track's, "
    "also one canceled while its worker was dead, are swept by the next heartbeat), running stages' "
    "temp folders (`work/`: a killed stage's is swept by the next heartbeat), local copies of `redis`- and "
    "`s3`-backend artifacts (`artifacts/`), the lip-sync source cache (`lipsync-sources/`)",
    "music_profile": "`tiny` (random weights, for tests and the demo), `shaped` (random weights, a memory-bound "
    "backbone whose share of a song's time and whose batching cost are an H200's: `bench/throughput.py --profile "
    "shaped`) or `khala` (the real checkpoints)",
    "model_dir": "where the profile's models live (unset: `models/<profile>`; for `khala`, a Khala checkout)",
    "model_paths": "where each model lies, when not in the profile's layout under `ENCORE_MODEL_DIR` (absolute, "
    "or relative to it; a `*` in the codec file picks the highest training step)",
    "song_end": "`model`: the backbone may sample end-of-text and the song ends where the model ends it; "
    "`duration`: exactly the requested length (unset: the profile's, `khala` model, `tiny` duration)",
    "song_margin_s": "with `ENCORE_SONG_END=model`, a song is cut at its requested duration plus this (and at "
    "the reference's 23,552 generated tokens)",
    "runtime_mode": "`keep_loaded`: all models stay resident; `one_shot`: tokenizer and backbone stay, "
    "super-resolution and codec are freed after their stage",
    "batch_tracks": "with `ENCORE_BACKBONE_SLOTS=1`: how many tracks of one song waiting on the same worker share "
    "one batched backbone pass (1: none); needs the `torch` engine",
    "engine_matmul": "how the engine's slots share a linear layer: `exact` (once per track, the very product the "
    "track makes alone: its codes equal the reference loop's; every track reads the weights again) or `batched` "
    "(one product over fixed 16-row tiles of all slots: batch-invariant, so a seed still means a song in every "
    "engine, but not bitwise the reference loop's; what a memory-bound GPU needs)",
    "backbone_slots": "tracks (of any jobs) a GPU worker's in-flight backbone engine decodes together, joining and "
    "leaving between blocks (`docs/performance.md`); 0: as many as a track's KV cache at the model's full length "
    "fits in 80 % of the device's free memory, at most 16, halved on out-of-memory; 1: no engine (one song's tracks "
    "at a time, `ENCORE_BATCH_TRACKS`); needs the `torch` engine",
    "music_engine": "transformer engine of the music stages: `torch` (plain PyTorch with a static KV cache, "
    "`app/pipeline/music/torch_engine.py`) or `megatron` (megatron-core's own forward, the "
    "reference); megatron-core loads the checkpoints either way",
    "preload_models": "`1`: each worker child loads its models before it takes jobs (what `/readyz` waits for)",
    "torch_threads": "CPU threads per worker child (0: torch's default)",
    "max_tracks": "most tracks per music job",
    "max_lyrics_chars": "lyrics size limit (characters)",
    "max_text_chars": "tags / prompt size limit (characters)",
    "time_limits": "per-stage `soft/hard` seconds over the defaults "
    f"`{DEFAULT_TIME_LIMITS}`, e.g. `backbone=1500/1560,decode=/600` (an empty soft: none)",
    "max_retries": "most retries of one track through `POST /api/v1/jobs/<id>/retry` (403 naming `retries` past it; "
    "0: none)",
    "max_deliveries": "a stage delivered (or restarted) more often than this, its worker dying each time, "
    "fails the track; its deaths count whoever noticed them (the next delivery or the reaper), and past this many "
    "in all the next one fails it too",
    "cancel_grace_s": "after a cancel, how long a running stage may take to stop before its child is killed",
    "reroute_after_s": "move the open tracks of a queue whose every worker has been offline this long to live "
    "queues (0: never)",
    "lease_s": "a running stage's lease (renewed every third of it); a running track whose lease expired is "
    "started again from its first unfinished stage",
    "stall_after_s": "a track waiting this long for a message that is in no broker list and not delivered gets "
    "it sent again",
    "heartbeat_s": "worker heartbeat period; a worker is offline after about 3 missed beats",
    "result_expires_s": "Celery result expiry (seconds)",
    "lipsync_profile": "`tiny` (random weights) or `musetalk` (real MuseTalk v1.5 weights)",
    "lipsync_model_dir": "the MuseTalk layout (unset: `models/lipsync-<profile>`)",
    "lipsync_precision": "MuseTalk's dtype: `auto` (fp16 on CUDA, fp32 on CPU), `fp16` or `fp32`; `fp16` on a "
    "CPU runs (about 2x slower than fp32 here) where its half kernels work, else the model "
    "load fails saying so",
    "max_video_mb": "face video upload limit (MB; 413 above it)",
    "max_audio_mb": "driving audio upload limit (MB; 413 above it)",
    "min_video_s": "shortest face video (seconds; 400 below)",
    "max_audio_s": "longest driving audio (seconds; 400 above)",
    "min_audio_s": "shortest driving audio (seconds, never less than one output frame period; 400 below)",
    "max_scratch_mb": "most worker scratch for one lip-sync job's decoded source frames (MiB; the frames its output "
    "shows x width x height x 3): 400 at submit when the upload would pass it, and the stage "
    "fails saying so if decoding does",
    "max_video_s": "longest face video (seconds: its frames, counted from the packets, over its frame rate; 400 above)",
    "max_video_frame_pixels": "most decoding work in one face video: frames x width x height (5 minutes of 30 fps "
    "1080p; 400 above)",
    "max_video_pixels": "largest face video, width x height from ffprobe (4096x2160; 400 above, before any "
    "frame is decoded)",
    "upload_dir": "where uploads are staged while they are checked",
    "ffmpeg_timeout_s": "timeout of each ffmpeg call in the lip-sync stages (seconds)",
    "ffmpeg": "the ffmpeg binary every media call runs, the music export's pydub included",
    "ffprobe": "the ffprobe binary every media call runs",
    "lipsync_mask": "lip-sync blend mask: `jaw` (drawn from the 68 landmarks, as MuseTalk's 'jaw' parsing mode) "
    "or `rectangle` (the box's lower half; also whenever landmarks are missing)",
    "lipsync_path": "lip-sync's per-frame work: `device` (crops, resizes and blend as tensor ops on the model's "
    "device) or `reference` (OpenCV on the CPU, MuseTalk's own operations)",
    "face_threads": "threads finding faces in the prepare stage; 0: one per core, at most 8",
    "lipsync_cache_mb": "the per-source-video cache (faces and VAE latents of a face video) in "
    "`ENCORE_WORKER_CACHE_DIR/lipsync-sources`, in MiB, least recently used out; 0: off",
    "lipsync_warmup": "with `ENCORE_PRELOAD=1`, one warm-up batch through MuseTalk at preload",
    "api_tokens": "bearer token(s) required on `/api/*` and the Khala-compatible routes (a comma-separated "
    "list allowed); unset or empty: no auth; an empty entry (`,`, `a,,b`) refuses to start",
    "admin_tokens": "bearer tokens of the `admin` tenant (operator routes, every tenant's jobs), beside "
    "`API_TOKEN`'s client tenants ([security](security.md#tenants))",
    "tenants_file": "a JSON file of tenants, their roles and their tokens' SHA-256 digests "
    "([security](security.md#tenants)); unreadable or malformed: the web and the workers refuse to start",
    "compat_prefix": "URL prefix of the Khala-compatible routes (they are always under `/api` too)",
    "tags_file": "the tag catalogue served by `GET /tags` (unset: `app/http/khala_tags.json`)",
    "cuda_visible_devices": "set by `worker_entrypoint.sh`; shown as the worker's `pinned_to` in the registry "
    "and the cards its GPU readings cover (never read to pick a device)",
    "flower_basic_auth": "Flower's `user:password[,...]` (unset: a random password is generated and printed)",
    "flower_port": "Flower's port",
    "flower_address": "Flower's bind address",
    "flower_db": "Flower's persistent state file",
    "client_url": "the CLI's (and the demo's) server",
    "client_token": "the bearer token the CLI sends (the demo also sends `API_TOKEN`)",
    "demo_web_url": "where the demo looks for (or starts) the web server",
    "web_bind": "the web server's bind address (`gunicorn.conf.py`)",
    "web_workers": "gthread processes of the web server (compose runs 4)",
    "web_threads": "threads per web process (an event stream the web serves itself holds one: at most half of them, "
    "and with tenants at most half of those for one tenant)",
    "body_idle_s": "a request body that sends nothing this long is answered 408 and dropped",
    "sse_heartbeat_s": "a `: heartbeat` comment on an idle event stream this often (on the events server, also when a "
    "gone client is noticed)",
    "sse_max_s": "the longest one event stream stays open (the client resumes with `Last-Event-ID`)",
    "events_maxlen": "events kept per job for replay (the stream `encore:job:<id>:events`, expiring with the job)",
    "events_bind": "the events server's bind address (`python -m app events`: event streams on one asyncio loop)",
    "events_url": "the events server's public base URL, e.g. `http://events.example.com:8001`: the web answers "
    "`GET /api/v1/jobs/<id>/events` with a 307 there (a signed ticket in the query); unset: the web serves streams "
    "itself, at most half of `ENCORE_WEB_THREADS` per process (429 `streams` past it)",
    "max_streams_per_tenant": "most event streams one tenant holds open at once on the events servers (429 "
    "`streams` with `Retry-After` past it)",
    "webhook_secret": "Standard Webhooks signing secret (`whsec_` + base64); unset: a submit with a webhook is "
    "refused (400)",
    "webhook_hosts": "comma list of hosts a webhook may name (`.example.com`: it and its subdomains; "
    "`host:8443`: that port too, beside 80 and 443); unset: any public host",
    "webhook_allow_private": "comma list of non-public addresses or networks a webhook may reach (`10.0.0.0/8`; "
    "`127.0.0.1:8080`, `[::1]:8080`: that port only); unset: public addresses only",
    "webhook_queue": "the webhook worker's queue (never a GPU queue)",
    "webhook_max_attempts": "delivery attempts of one webhook",
    "webhook_backoff_s": "delay before the first retry of a webhook (doubling each attempt)",
    "webhook_backoff_cap_s": "the longest delay between two attempts",
    "webhook_timeout_s": "one webhook request's timeout (seconds)",
    "webhook_history": "delivery attempts kept in a job record",
    "webhook_progress_s": "least seconds between a job's progress webhooks",
    "otel_endpoint": "OpenTelemetry tracing over OTLP/HTTP (`app/adapters/tracing.py`); unset: tracing off",
    "otel_service_name": "spans come from `<name>-web` and `<name>-worker`",
    "max_queued_tracks": "most open (not ended) tracks in all (0: no cap); a submit past it is 429 with "
    "`Retry-After` from the ETA, and not created",
    "max_queued_tracks_per_queue": "most open tracks on each live GPU queue (0: no cap; a full queue takes no "
    "new track; 429 when none has room)",
    "submit_rate_limit": "each tenant's rate limit of the submit routes together (per address where no token is "
    "configured), e.g. `10/minute;200/day` (429 with Retry-After past it); `off`: none; a tenants file may set a "
    "tenant's own",
    "tenant_max_open_tracks": "most open (not ended) tracks of one tenant at once (0: no cap); a submit past it is "
    "429 `tracks` with Retry-After; a tenants file may set a tenant's own",
    "tenant_max_priority": "the highest priority a client tenant's jobs may ask for (`low`, `normal` or `high`; "
    "admins may always use `high`); past it: 403 `priority`",
    "rate_limit_strategy": "the rate limit's window: `fixed-window`, `moving-window` or `sliding-window-counter`",
    "eta_alpha": "weight of a finished stage in its queue's learned seconds per cost unit (ETA, routing)",
}


def load_settings() -> Settings:
    return Settings()
