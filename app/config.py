"""Every setting Encore reads, in one place, from environment variables (see the README's table).

Settings are read when `load_settings()` is called, so tests and the demo can set the environment first.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.pipeline.profiles import MusicProfile


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _time_limits(spec: str) -> dict[str, tuple[float | None, float]]:
    """Parse "backbone=1500/1800,decode=/600" into {stage: (soft, hard)}; an empty soft means none."""
    limits: dict[str, tuple[float | None, float]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        stage, _, pair = item.partition("=")
        soft, _, hard = pair.partition("/")
        limits[stage.strip()] = (float(soft) if soft.strip() else None, float(hard))
    return limits


MODEL_PATH_VARIABLES = {"tokenizer_subdir": "ENCORE_TOKENIZER_DIR", "backbone_subdir": "ENCORE_BACKBONE_DIR",
                        "superres_subdir": "ENCORE_SUPERRES_DIR", "codec_file": "ENCORE_CODEC_FILE"}

DEFAULT_WEB_URL = "http://127.0.0.1:8000"

LIPSYNC_PRECISIONS = ("auto", "fp16", "fp32")
LIPSYNC_MASKS = ("jaw", "rectangle")  # app/pipeline/lipsync/inference.py draws them
LIPSYNC_PATHS = ("device", "reference")  # inference.run_lipsync's two ways of doing the per-frame work
RATE_LIMIT_STRATEGIES = ("fixed-window", "moving-window", "sliding-window-counter")  # limits' names

DEFAULT_TIME_LIMITS = (
    "backbone=1500/1560,superres=900/960,decode=900/960,export=300/330,"
    "prepare=300/330,lipsync=1500/1560,mux=300/330"
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


@dataclass(frozen=True)
class Settings:
    redis_url: str = field(default_factory=lambda: _env("REDIS_URL", "redis://127.0.0.1:6379/0"))
    # Redis Sentinel (app/redis_conn.py): "host:port,host:port,..." of the sentinels and the monitored primary's
    # name; then REDIS_URL only gives the database and the primary's password. Sentinels' own password apart.
    redis_sentinels: tuple[tuple[str, int], ...] = field(default_factory=lambda: _sentinels(_env("REDIS_SENTINELS", "")))
    redis_sentinel_master: str = field(default_factory=lambda: _env("REDIS_SENTINEL_MASTER", "mymaster"))
    redis_sentinel_password: str = field(default_factory=lambda: _env("REDIS_SENTINEL_PASSWORD", ""), repr=False)
    key_prefix: str = field(default_factory=lambda: _env("ENCORE_KEY_PREFIX", "encore"))
    job_ttl_s: int = field(default_factory=lambda: int(_env("ENCORE_JOB_TTL_S", str(24 * 3600))))
    artifact_backend: str = field(default_factory=lambda: _env("ENCORE_ARTIFACT_BACKEND", "dir"))
    artifact_dir: Path = field(default_factory=lambda: Path(_env("ENCORE_ARTIFACT_DIR", "var/artifacts")).resolve())
    # The s3 backend (app/artifacts.py S3Store): endpoint (empty: AWS), bucket, key prefix, region; credentials as
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
    s3_presign_s: int = field(default_factory=lambda: int(_env("ENCORE_S3_PRESIGN_S", "900"))
                              if _env("ENCORE_S3_PRESIGN", "0") == "1" else 0)
    worker_cache_dir: Path = field(default_factory=lambda: Path(_env("ENCORE_WORKER_CACHE_DIR", "var/worker-cache")).resolve())
    music_profile: str = field(default_factory=lambda: _env("ENCORE_MUSIC_PROFILE", "tiny"))
    model_dir: str | None = field(default_factory=lambda: os.environ.get("ENCORE_MODEL_DIR"))
    # Each model's location, overriding the profile's layout under ENCORE_MODEL_DIR (absolute, or relative to it).
    model_paths: dict[str, str] = field(default_factory=lambda: {
        name: os.environ[variable] for name, variable in MODEL_PATH_VARIABLES.items() if os.environ.get(variable)})
    song_end: str | None = field(default_factory=lambda: os.environ.get("ENCORE_SONG_END") or None)
    song_margin_s: float = field(default_factory=lambda: float(_env("ENCORE_SONG_MARGIN_S", "90")))
    runtime_mode: str = field(default_factory=lambda: _env("ENCORE_RUNTIME_MODE", "keep_loaded"))
    batch_tracks: int = field(default_factory=lambda: int(_env("ENCORE_BATCH_TRACKS", "2")))
    music_engine: str = field(default_factory=lambda: _env("ENCORE_MUSIC_ENGINE", "torch"))
    preload_models: bool = field(default_factory=lambda: _env("ENCORE_PRELOAD", "0") == "1")
    torch_threads: int = field(default_factory=lambda: int(_env("ENCORE_TORCH_THREADS", "0")))
    max_tracks: int = field(default_factory=lambda: int(_env("ENCORE_MAX_TRACKS", "4")))
    max_lyrics_chars: int = field(default_factory=lambda: int(_env("ENCORE_MAX_LYRICS_CHARS", "8000")))
    max_text_chars: int = field(default_factory=lambda: int(_env("ENCORE_MAX_TEXT_CHARS", "1000")))
    time_limits: dict[str, tuple[float | None, float]] = field(
        default_factory=lambda: {**_time_limits(DEFAULT_TIME_LIMITS), **_time_limits(_env("ENCORE_TIME_LIMITS", ""))})
    max_deliveries: int = field(default_factory=lambda: int(_env("ENCORE_MAX_DELIVERIES", "3")))
    cancel_grace_s: float = field(default_factory=lambda: float(_env("ENCORE_CANCEL_GRACE_S", "3")))
    reroute_after_s: float = field(default_factory=lambda: float(_env("ENCORE_REROUTE_AFTER_S", "30")))
    lease_s: float = field(default_factory=lambda: float(_env("ENCORE_LEASE_S", "15")))
    # A track waiting this long for a message that is in no broker list and not delivered gets it again.
    stall_after_s: float = field(default_factory=lambda: float(_env("ENCORE_STALL_AFTER_S", "30")))
    heartbeat_s: float = field(default_factory=lambda: float(_env("ENCORE_HEARTBEAT_S", "2")))
    result_expires_s: int = field(default_factory=lambda: int(_env("ENCORE_RESULT_EXPIRES_S", str(24 * 3600))))
    lipsync_profile: str = field(default_factory=lambda: _env("ENCORE_LIPSYNC_PROFILE", "tiny"))
    lipsync_model_dir: str | None = field(default_factory=lambda: os.environ.get("ENCORE_LIPSYNC_MODEL_DIR"))
    # MuseTalk's dtype: auto (fp16 on CUDA, fp32 on CPU), fp16 or fp32 (fp16 on a CPU only where it runs).
    lipsync_precision: str = field(default_factory=lambda: _env("ENCORE_LIPSYNC_PRECISION", "auto").strip().lower())
    max_video_mb: float = field(default_factory=lambda: float(_env("ENCORE_MAX_VIDEO_MB", "100")))
    max_audio_mb: float = field(default_factory=lambda: float(_env("ENCORE_MAX_AUDIO_MB", "20")))
    min_video_s: float = field(default_factory=lambda: float(_env("ENCORE_MIN_VIDEO_S", "3")))
    max_audio_s: float = field(default_factory=lambda: float(_env("ENCORE_MAX_AUDIO_S", "600")))
    # The shortest driving audio a lip-sync job takes (never less than one output frame period).
    min_audio_s: float = field(default_factory=lambda: float(_env("ENCORE_MIN_AUDIO_S", "0.5")))
    # Width × height of the largest face video (4096×2160): a bigger one is refused from its probe, before its
    # frames are ever decoded.
    max_video_pixels: int = field(default_factory=lambda: int(_env("ENCORE_MAX_VIDEO_PIXELS", str(4096 * 2160))))
    upload_dir: Path = field(default_factory=lambda: Path(_env("ENCORE_UPLOAD_DIR", "var/uploads")).resolve())
    ffmpeg_timeout_s: float = field(default_factory=lambda: float(_env("ENCORE_FFMPEG_TIMEOUT_S", "600")))
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
    face_threads: int = field(default_factory=lambda: int(_env("ENCORE_FACE_THREADS", "0")))
    # The per-source-video cache (face track and VAE latents of a face video, for the next job on the same
    # video) under ENCORE_WORKER_CACHE_DIR/lipsync-sources, at most this many MiB, least recently used out; 0: off.
    lipsync_cache_mb: float = field(default_factory=lambda: float(_env("ENCORE_LIPSYNC_CACHE_MB", "2048")))
    # A warm-up batch through MuseTalk when the worker preloads it (first-call kernel choices off the clock).
    lipsync_warmup: bool = field(default_factory=lambda: _env("ENCORE_LIPSYNC_WARMUP", "1") == "1")
    api_tokens: tuple[str, ...] = field(default_factory=lambda: tuple(
        t.strip() for t in _env("API_TOKEN", "").split(",") if t.strip()))
    compat_prefix: str = field(default_factory=lambda: _env("ENCORE_COMPAT_PREFIX", "").rstrip("/"))
    tags_file: Path | None = field(default_factory=lambda: Path(os.environ["ENCORE_TAGS_FILE"])
                                   if os.environ.get("ENCORE_TAGS_FILE") else None)
    # What the worker is pinned to (worker_entrypoint.sh sets it), shown in its registry entry; never read to
    # pick a device: CUDA itself honours it.
    cuda_visible_devices: str = field(default_factory=lambda: _env("CUDA_VISIBLE_DEVICES", ""))
    # Flower (flowerconfig.py): basic-auth "user:password[,…]" (empty: one is generated), bind, state file.
    flower_basic_auth: str = field(default_factory=lambda: _env("ENCORE_FLOWER_BASIC_AUTH", "").strip())
    flower_port: int = field(default_factory=lambda: int(_env("ENCORE_FLOWER_PORT", "5555")))
    flower_address: str = field(default_factory=lambda: _env("ENCORE_FLOWER_ADDRESS", "0.0.0.0"))
    flower_db: str = field(default_factory=lambda: _env("ENCORE_FLOWER_DB", "var/flower.db"))
    # The HTTP clients (app/cli.py, app/demo.py): the server they talk to and the bearer token they send.
    client_url: str = field(default_factory=lambda: _env("ENCORE_URL", DEFAULT_WEB_URL))
    client_token: str | None = field(default_factory=lambda: os.environ.get("ENCORE_API_TOKEN") or None)
    demo_web_url: str = field(default_factory=lambda: _env("ENCORE_WEB_URL", DEFAULT_WEB_URL))
    # The web server (gunicorn.conf.py): where it listens, processes × threads, and how long a request body may
    # send nothing before the client is answered 408 and dropped.
    web_bind: str = field(default_factory=lambda: _env("ENCORE_WEB_BIND", "0.0.0.0:8000"))
    web_workers: int = field(default_factory=lambda: int(_env("ENCORE_WEB_WORKERS", "2")))
    web_threads: int = field(default_factory=lambda: int(_env("ENCORE_WEB_THREADS", "32")))
    body_idle_s: float = field(default_factory=lambda: float(_env("ENCORE_BODY_IDLE_S", "30")))
    # Server-sent events (GET /api/v1/jobs/<id>/events): a comment this often (it is also when a gone client is
    # noticed), and the longest one stream holds its gthread thread before it ends (the client resumes with
    # Last-Event-ID); the job's stream keeps its newest ENCORE_EVENTS_MAXLEN events for replay.
    sse_heartbeat_s: float = field(default_factory=lambda: float(_env("ENCORE_SSE_HEARTBEAT_S", "15")))
    sse_max_s: float = field(default_factory=lambda: float(_env("ENCORE_SSE_MAX_S", "3600")))
    events_maxlen: int = field(default_factory=lambda: int(_env("ENCORE_EVENTS_MAXLEN", "1000")))
    # Webhooks (app/webhooks.py): the signing secret ("whsec_" + base64, Standard Webhooks; none: submits with a
    # webhook are refused), the hosts a webhook may name (comma list; ".example.com" takes its subdomains; empty:
    # any), the queue of the webhook worker, attempts and their backoff, the request timeout, how many attempts
    # a job keeps, and the least seconds between a job's progress webhooks.
    webhook_secret: str = field(default_factory=lambda: _env("ENCORE_WEBHOOK_SECRET", ""))
    webhook_hosts: tuple[str, ...] = field(default_factory=lambda: tuple(
        h.strip().lower() for h in _env("ENCORE_WEBHOOK_HOSTS", "").split(",") if h.strip()))
    webhook_queue: str = field(default_factory=lambda: _env("ENCORE_WEBHOOK_QUEUE", "webhooks"))
    webhook_max_attempts: int = field(default_factory=lambda: int(_env("ENCORE_WEBHOOK_MAX_ATTEMPTS", "8")))
    webhook_backoff_s: float = field(default_factory=lambda: float(_env("ENCORE_WEBHOOK_BACKOFF_S", "1")))
    webhook_backoff_cap_s: float = field(default_factory=lambda: float(_env("ENCORE_WEBHOOK_BACKOFF_CAP_S", "300")))
    webhook_timeout_s: float = field(default_factory=lambda: float(_env("ENCORE_WEBHOOK_TIMEOUT_S", "10")))
    webhook_history: int = field(default_factory=lambda: int(_env("ENCORE_WEBHOOK_HISTORY", "50")))
    webhook_progress_s: float = field(default_factory=lambda: float(_env("ENCORE_WEBHOOK_PROGRESS_S", "5")))
    # Tracing (app/tracing.py): on when OpenTelemetry's standard OTEL_EXPORTER_OTLP_ENDPOINT is set (OTLP/HTTP);
    # spans carry the service name OTEL_SERVICE_NAME + "-web" / "-worker".
    otel_endpoint: str = field(default_factory=lambda: _env("OTEL_EXPORTER_OTLP_ENDPOINT", ""))
    otel_service_name: str = field(default_factory=lambda: _env("OTEL_SERVICE_NAME", "encore"))
    # Back-pressure (app/quotas.py): the most open (not ended) tracks in all, and on each live queue; a submit
    # that would pass either is refused 429 with a Retry-After from the ETA. 0: no cap.
    max_queued_tracks: int = field(default_factory=lambda: int(_env("ENCORE_MAX_QUEUED_TRACKS", "0")))
    max_queued_tracks_per_queue: int = field(default_factory=lambda: int(
        _env("ENCORE_MAX_QUEUED_TRACKS_PER_QUEUE", "0")))
    # Per-token rate limit of the submit routes (app/ratelimit.py), in Flask-Limiter's notation ("10/minute",
    # "5/second;100/hour"); empty: none. Its window strategy: fixed-window, moving-window or sliding-window-counter.
    submit_rate_limit: str = field(default_factory=lambda: _env("ENCORE_SUBMIT_RATE_LIMIT", "").strip())
    rate_limit_strategy: str = field(default_factory=lambda: _env("ENCORE_RATE_LIMIT_STRATEGY", "fixed-window"))
    # ETA (app/eta.py): the weight of a finished stage's seconds in its queue's learned rate (exponential mean), the
    # one average the ETAs, routing and /metrics' encore_stage_seconds_per_unit read.
    eta_alpha: float = field(default_factory=lambda: float(_env("ENCORE_ETA_ALPHA", "0.3")))

    def __post_init__(self) -> None:
        if self.runtime_mode not in ("keep_loaded", "one_shot"):
            raise ValueError(f"ENCORE_RUNTIME_MODE must be keep_loaded or one_shot, not {self.runtime_mode!r}")
        if self.music_engine not in ("torch", "megatron"):
            raise ValueError(f"ENCORE_MUSIC_ENGINE must be torch or megatron, not {self.music_engine!r}")
        if self.song_end not in (None, "model", "duration"):
            raise ValueError(f"ENCORE_SONG_END must be model or duration, not {self.song_end!r}")
        if self.lease_s < 1:
            raise ValueError(f"ENCORE_LEASE_S must be >= 1, not {self.lease_s}")
        if self.song_margin_s < 0:
            raise ValueError(f"ENCORE_SONG_MARGIN_S must be >= 0, not {self.song_margin_s}")
        if self.lipsync_mask not in LIPSYNC_MASKS:
            raise ValueError(f"ENCORE_LIPSYNC_MASK must be jaw or rectangle, not {self.lipsync_mask!r}")
        if self.lipsync_path not in LIPSYNC_PATHS:
            raise ValueError(f"ENCORE_LIPSYNC_PATH must be device or reference, not {self.lipsync_path!r}")
        if self.face_threads < 0 or self.lipsync_cache_mb < 0:
            raise ValueError("ENCORE_FACE_THREADS and ENCORE_LIPSYNC_CACHE_MB must be >= 0")
        if self.artifact_backend not in ("dir", "redis", "s3"):
            raise ValueError(f"ENCORE_ARTIFACT_BACKEND must be dir, redis or s3, not {self.artifact_backend!r}")
        if self.sse_heartbeat_s <= 0 or self.sse_max_s <= 0:
            raise ValueError("ENCORE_SSE_HEARTBEAT_S and ENCORE_SSE_MAX_S must be > 0")
        if self.webhook_max_attempts < 1 or self.webhook_backoff_s <= 0 or self.webhook_timeout_s <= 0:
            raise ValueError("ENCORE_WEBHOOK_MAX_ATTEMPTS must be >= 1, the backoff and timeout > 0")
        if self.webhook_queue.startswith("gpu"):
            raise ValueError(f"ENCORE_WEBHOOK_QUEUE must not be a GPU queue, not {self.webhook_queue!r}")
        if self.webhook_secret:
            from standardwebhooks import Webhook
            try:
                Webhook(self.webhook_secret)
            except Exception as exc:
                raise ValueError(f"ENCORE_WEBHOOK_SECRET must be whsec_ + base64: {exc}") from None
        if self.events_maxlen < 1:
            raise ValueError(f"ENCORE_EVENTS_MAXLEN must be >= 1, not {self.events_maxlen}")
        if self.max_queued_tracks < 0 or self.max_queued_tracks_per_queue < 0:
            raise ValueError("ENCORE_MAX_QUEUED_TRACKS and ENCORE_MAX_QUEUED_TRACKS_PER_QUEUE must be >= 0")
        if not 0 < self.eta_alpha <= 1:
            raise ValueError(f"ENCORE_ETA_ALPHA must be in (0, 1], not {self.eta_alpha}")
        if self.rate_limit_strategy not in RATE_LIMIT_STRATEGIES:
            raise ValueError(f"ENCORE_RATE_LIMIT_STRATEGY must be one of {', '.join(RATE_LIMIT_STRATEGIES)}, "
                             f"not {self.rate_limit_strategy!r}")
        if self.submit_rate_limit:
            from limits import parse_many
            try:
                parse_many(self.submit_rate_limit)
            except ValueError as exc:
                raise ValueError(f"ENCORE_SUBMIT_RATE_LIMIT: {exc}") from None
        if self.lipsync_precision not in LIPSYNC_PRECISIONS:
            raise ValueError(f"ENCORE_LIPSYNC_PRECISION must be auto, fp16 or fp32, not {self.lipsync_precision!r}")

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


def load_settings() -> Settings:
    return Settings()
