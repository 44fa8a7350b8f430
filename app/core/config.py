"""Every setting Encore reads, in one place, from environment variables: each `Settings` field is declared once by
`setting()`, with its variable, default, description, parser and bounds, and docs/configuration.md's table is
printed from those declarations by scripts/config_table.py.

Settings are read when `load_settings()` is called, so tests and the demo can set the environment first.
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.core.tenants import PRIORITY_LEVELS, TenantDirectory, check_rate, tenant_directory
from app.pipeline.lipsync.options import LIPSYNC_MASKS, LIPSYNC_PATHS, LIPSYNC_PRECISIONS  # the pipeline's own

if TYPE_CHECKING:
    from app.pipeline.profiles import MusicProfile


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

DEFAULT_SUBMIT_RATE_LIMIT = "300/minute"  # per tenant (per address where no token is configured): a batch of jobs
# passes, a flood does not (and ENCORE_TENANT_MAX_OPEN_TRACKS bounds what a tenant has open at once)


# -- declaring a setting ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bounds:
    """What a numeric setting may be: a value that makes no sense refuses to start instead of misbehaving later.
    Zero is allowed only where it means something (the description says what, as "0: ...")."""

    least: float
    least_allowed: bool = True  # False: the value must be above `least`
    most: float | None = None

    def check(self, variable: str, value: float) -> None:
        """Refuse a value out of bounds, naming its variable."""
        if value < self.least or (value == self.least and not self.least_allowed):
            raise ValueError(f"{variable} must be {'>=' if self.least_allowed else '>'} {self.least:g}, not {value}")
        if self.most is not None and value > self.most:
            raise ValueError(f"{variable} must be <= {self.most:g}, not {value}")


ONE_OR_MORE = Bounds(1)
ZERO_OR_MORE = Bounds(0)  # where 0 means something
ABOVE_ZERO = Bounds(0, least_allowed=False)

# A parser turns the variables' texts (None for one that is unset and has no default) into the field's value;
# it is given the setting's (first) variable to name in its messages.
Parser = Callable[..., Any]


@dataclass(frozen=True)
class Declaration:
    """One setting, said once: the variables it reads with their defaults, what it means, how its text becomes a
    value, and its bounds. Kept in its `Settings` field's metadata, where scripts/config_table.py reads it."""

    variables: tuple[tuple[str, str | None], ...]  # (variable, default); a None default: read without one
    description: str
    parse: Parser
    bounds: Bounds | None = None

    @property
    def variable(self) -> str:
        """The variable that names the setting in its error messages."""
        return self.variables[0][0]

    def read(self) -> Any:
        """The value from the environment; a bad value refuses to start, its message naming the variable."""
        texts = [os.environ.get(name, default) for name, default in self.variables]
        try:
            return self.parse(self.variable, *texts)
        except ValueError as exc:
            if self.variable in str(exc):
                raise
            raise ValueError(f"{self.variable}: {exc}") from None


def _text(variable: str, text: str | None) -> str | None:
    """The text as it is (None where the variable is unset and has no default)."""
    return text


def _variable_and_default(spec: str) -> tuple[str, str | None]:
    """Split a declared variable as a shell writes it: "NAME=default" is (NAME, default), "NAME=" (NAME, ""), and
    a bare "NAME" (NAME, None), read without a default, so that unset and empty can differ."""
    name, assigned, default = spec.partition("=")
    return name, default if assigned else None


def setting(
    variables: str | tuple[str, ...],
    description: str,
    *,
    parse: Parser = _text,
    bounds: Bounds | None = None,
    secret: bool = False,
) -> Any:
    """A `Settings` field read from the environment: `variables` is "NAME=default" as a shell writes it (or several,
    for a parser that reads more than one); a `secret` one stays out of the repr, which is logged and shown in
    tracebacks."""
    specs = (variables,) if isinstance(variables, str) else variables
    declared = Declaration(tuple(map(_variable_and_default, specs)), description, parse, bounds)
    return field(default_factory=declared.read, repr=not secret, metadata={"declaration": declared})


def integer(variable: str, description: str, bounds: Bounds) -> Any:
    """An integer setting; its bounds are required, so no number goes unchecked."""
    return setting(variable, description, parse=_integer, bounds=bounds)


def number(variable: str, description: str, bounds: Bounds) -> Any:
    """A finite number setting; its bounds are required, so no number goes unchecked."""
    return setting(variable, description, parse=_number, bounds=bounds)


def flag(variable: str, description: str) -> Any:
    """An on/off setting: `1` is on, anything else off."""
    return setting(variable, description, parse=_flag)


def directory(variable: str, description: str) -> Any:
    """A directory, made absolute when read (so that a later change of directory does not move it)."""
    return setting(variable, description, parse=_resolved_path)


def declarations() -> dict[str, Declaration]:
    """Every `Settings` field's declaration, in the dataclass's order."""
    return {each.name: each.metadata["declaration"] for each in fields(Settings)}


# -- parsers: the variable names the setting, the text is the variable's value ----------------------------------------


def _integer(variable: str, text: str) -> int:
    """An integer; a value that is not one names its variable (int() alone would not say which)."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{variable} must be an integer, not {text!r}") from None


def _number(variable: str, text: str) -> float:
    """A finite number: "nan" and "inf" parse as floats but pass every bound check, so they are refused here."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{variable} must be a number, not {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{variable} must be a finite number, not {text!r}")
    return value


def _flag(variable: str, text: str) -> bool:
    """`1` is on; anything else is off."""
    return text == "1"


def _text_or_none(variable: str, text: str | None) -> str | None:
    """Unset and empty alike mean none."""
    return text or None


def _stripped(variable: str, text: str) -> str:
    """Without the white space a copied value brings along (a secret's trailing newline)."""
    return text.strip()


def _lower_case(variable: str, text: str) -> str:
    """A name compared in lower case, so that `FP16 ` means `fp16`."""
    return text.strip().lower()


def _url_path(variable: str, text: str) -> str:
    """A URL prefix without its trailing slash, so that routes can be appended to it."""
    return text.rstrip("/")


def _base_url(variable: str, text: str) -> str:
    """A base URL without its trailing slash, so that paths can be appended to it."""
    return text.strip().rstrip("/")


def _resolved_path(variable: str, text: str) -> Path:
    """An absolute path, so that a later change of directory does not move it."""
    return Path(text).resolve()


def _optional_path(variable: str, text: str | None) -> Path | None:
    """A path, or None when unset or empty."""
    return Path(text) if text else None


def _host_list(variable: str, text: str) -> tuple[str, ...]:
    """A comma list, lower case, empty entries dropped (each entry is checked in `Settings.__post_init__`)."""
    return tuple(host.strip().lower() for host in text.split(",") if host.strip())


def _presign_seconds(variable: str, seconds: str, presign: str) -> int:
    """ENCORE_S3_PRESIGN_S, read only with ENCORE_S3_PRESIGN=1; 0 (downloads streamed) otherwise."""
    return _integer(variable, seconds) if presign == "1" else 0


def _model_paths(variable: str, *paths: str | None) -> dict[str, str]:
    """Each model's location that is set (one variable each, in MODEL_PATH_VARIABLES' order)."""
    return {name: path for name, path in zip(MODEL_PATH_VARIABLES, paths, strict=True) if path}


def _time_limits(spec: str) -> dict[str, tuple[float | None, float]]:
    """Parse "backbone=1500/1800,decode=/600" into {stage: (soft, hard)}; an empty soft means none."""
    limits: dict[str, tuple[float | None, float]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        stage, _, pair = item.partition("=")
        soft, _, hard = pair.partition("/")
        limits[stage.strip()] = (float(soft) if soft.strip() else None, float(hard))
    return limits


def _time_limits_over_defaults(variable: str, text: str) -> dict[str, tuple[float | None, float]]:
    """ENCORE_TIME_LIMITS over DEFAULT_TIME_LIMITS: the stages it names change, the others keep their defaults."""
    return {**_time_limits(DEFAULT_TIME_LIMITS), **_time_limits(text)}


def _sentinels(variable: str, text: str) -> tuple[tuple[str, int], ...]:
    """REDIS_SENTINELS "host:port,host:port" as (host, port) pairs (port 26379 when left out)."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "26379")
        if not host or not port.isdigit():
            raise ValueError(f"{variable}: {item!r} is not host:port")
        pairs.append((host, int(port)))
    return tuple(pairs)


def _api_tokens(variable: str, text: str) -> tuple[str, ...]:
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


def _submit_rate(variable: str, text: str) -> str:
    """ENCORE_SUBMIT_RATE_LIMIT: a rate (checked in Settings), or `off` for none; empty is refused, so that no typo
    turns the limit off."""
    text = text.strip()
    if not text:
        raise ValueError(f"{variable} is empty: give a rate such as 10/minute, or `off` for none")
    if text.lower() == "off" and text != "off":
        raise ValueError(f"{variable}: {text!r}: write `off` (lower case) for no limit")
    return "" if text == "off" else text


def webhook_entry(entry: str, variable: str) -> tuple[str, int | None]:
    """One ENCORE_WEBHOOK_HOSTS or ENCORE_WEBHOOK_ALLOW_PRIVATE entry as (host or network, port or None): "name",
    "name:8443", "10.0.0.0/8", "127.0.0.1:8080", "::1", "[::1]:8080" (an IPv6 entry with a port is bracketed).
    Read here, at start, so that a typo stops the service instead of refusing every webhook later."""
    if entry.startswith("["):
        host, closed, rest = entry[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError(f"{variable}: {entry!r} is not [address] or [address]:port")
        port_text = rest[1:] if rest else None
    elif entry.count(":") == 1:
        host, port_text = entry.split(":")
    else:
        host, port_text = entry, None
    if not host or (port_text is not None and not (port_text.isdigit() and 0 < int(port_text) < 65536)):
        raise ValueError(f"{variable}: {entry!r} is not host or host:port (a port from 1 to 65535)")
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
    # Redis (app/adapters/redis_conn.py)
    redis_url: str = setting(
        "REDIS_URL=redis://127.0.0.1:6379/0",
        "broker, result backend, job records, registry; under Sentinel only the database and the primary's password",
        secret=True,
    )
    redis_sentinels: tuple[tuple[str, int], ...] = setting(
        "REDIS_SENTINELS=",
        "Redis through Sentinel (`app/adapters/redis_conn.py`): the sentinels as `host:port,host:port` (port 26379 "
        "when left out); empty: no Sentinel",
        parse=_sentinels,
    )
    redis_sentinel_master: str = setting(
        "REDIS_SENTINEL_MASTER=mymaster", "the name of the primary the sentinels monitor"
    )
    redis_sentinel_password: str = setting(
        "REDIS_SENTINEL_PASSWORD=", "the sentinels' own password, when they require one", secret=True
    )
    key_prefix: str = setting("ENCORE_KEY_PREFIX=encore", "prefix of Encore's Redis keys")
    job_ttl_s: int = integer(
        f"ENCORE_JOB_TTL_S={24 * 3600}",
        "job records, their artifacts and Idempotency-Keys expire after this many seconds",
        ONE_OR_MORE,
    )

    # Artifacts (app/adapters/artifacts.py) and each host's scratch
    artifact_backend: str = setting(
        "ENCORE_ARTIFACT_BACKEND=dir",
        "`dir` (shared directory), `redis` (chunked, expires with the job) or `s3` (an S3-compatible bucket)",
    )
    artifact_dir: Path = directory(
        "ENCORE_ARTIFACT_DIR=var/artifacts", "root of the `dir` backend (a shared volume across hosts)"
    )
    s3_endpoint: str = setting("ENCORE_S3_ENDPOINT=", "the `s3` backend's endpoint (empty: AWS S3)")
    s3_bucket: str = setting("ENCORE_S3_BUCKET=encore", "the `s3` backend's bucket")
    s3_prefix: str = setting(
        "ENCORE_S3_PREFIX=artifacts/", "key prefix of the `s3` backend's objects (`<prefix><job id>/<name>`)"
    )
    s3_region: str = setting("ENCORE_S3_REGION=us-east-1", "the `s3` backend's region")
    s3_access_key: str = setting(
        "AWS_ACCESS_KEY_ID=",
        "S3 credentials (the standard variable; unset: boto3's own chain, a profile or an instance role)",
        secret=True,
    )
    s3_secret_key: str = setting(
        "AWS_SECRET_ACCESS_KEY=", "S3 credentials (the standard variable; unset: boto3's own chain)", secret=True
    )
    s3_presign_s: int = setting(
        ("ENCORE_S3_PRESIGN_S=900", "ENCORE_S3_PRESIGN=0"),
        "with `ENCORE_S3_PRESIGN=1`, downloads are answered 302 to a URL presigned for `ENCORE_S3_PRESIGN_S` seconds "
        "instead of streamed through the web",
        parse=_presign_seconds,
        bounds=Bounds(0, most=7 * 24 * 3600),  # S3 presigns for at most a week
    )
    worker_cache_dir: Path = directory(
        "ENCORE_WORKER_CACHE_DIR=var/worker-cache",
        "each host's local scratch: lip-sync track intermediates (`tracks/`: an ended track's, also one canceled "
        "while its worker was dead, are swept by the next heartbeat), running stages' temp folders (`work/`: a "
        "killed stage's is swept by the next heartbeat), local copies of `redis`- and `s3`-backend artifacts "
        "(`artifacts/`), the lip-sync source cache (`lipsync-sources/`)",
    )

    # The music pipeline (app/pipeline/profiles.py, app/pipeline/music/)
    music_profile: str = setting(
        "ENCORE_MUSIC_PROFILE=tiny",
        "`tiny` (random weights, for tests and the demo), `shaped` (random weights, a memory-bound backbone whose "
        "share of a song's time and whose batching cost are an H200's: `bench/throughput.py --profile shaped`) or "
        "`khala` (the real checkpoints)",
    )
    model_dir: str | None = setting(
        "ENCORE_MODEL_DIR", "where the profile's models live (unset: `models/<profile>`; for `khala`, a Khala checkout)"
    )
    model_paths: dict[str, str] = setting(
        tuple(MODEL_PATH_VARIABLES.values()),
        "where each model lies, when not in the profile's layout under `ENCORE_MODEL_DIR` (absolute, or relative to "
        "it; a `*` in the codec file picks the highest training step)",
        parse=_model_paths,
    )
    song_end: str | None = setting(
        "ENCORE_SONG_END",
        "`model`: the backbone may sample end-of-text and the song ends where the model ends it; `duration`: exactly "
        "the requested length (unset: the profile's, `khala` model, `tiny` duration)",
        parse=_text_or_none,
    )
    song_margin_s: float = number(
        "ENCORE_SONG_MARGIN_S=90",
        "with `ENCORE_SONG_END=model`, a song is cut at its requested duration plus this (and at the reference's "
        "23,552 generated tokens)",
        ZERO_OR_MORE,
    )
    runtime_mode: str = setting(
        "ENCORE_RUNTIME_MODE=keep_loaded",
        "`keep_loaded`: all models stay resident; `one_shot`: tokenizer and backbone stay, super-resolution and "
        "codec are freed after their stage",
    )
    batch_tracks: int = integer(
        "ENCORE_BATCH_TRACKS=2",
        "with `ENCORE_BACKBONE_SLOTS=1`: how many tracks of one song waiting on the same worker run in one backbone "
        "stage, decoded together block by block, each in a slot of its own (1: none); needs the `torch` engine",
        ONE_OR_MORE,
    )
    backbone_slots: int = integer(
        "ENCORE_BACKBONE_SLOTS=0",
        "tracks (of any jobs) a GPU worker's in-flight backbone engine decodes together, joining and leaving between "
        "blocks (`docs/performance.md`); 0: as many as a track's KV cache at the model's full length fits in 80 % of "
        "the device's free memory, at most 16, halved on out-of-memory; 1: no engine (one song's tracks at a time, "
        "`ENCORE_BATCH_TRACKS`); needs the `torch` engine",
        Bounds(0, most=256),
    )
    engine_matmul: str = setting(
        "ENCORE_ENGINE_MATMUL=exact",
        "how the engine's slots share a layer: `exact` (linears and attention once per track, the very calls the "
        "track makes alone: its codes equal the reference loop's; every track reads the weights again) or `batched` "
        "(one product over fixed 16-row tiles of all slots, one attention call over all slots summing keys in fixed "
        "64-key blocks: batch-invariant, so a seed still means a song in every engine, but not bitwise the reference "
        "loop's; what a memory-bound GPU needs; on CUDA a whole frame of fixed shapes over every slot, its attention "
        "one fused call, so a seed means a song among engines of one slot count: `docs/performance.md`)",
    )
    engine_graphs: bool = flag(
        "ENCORE_ENGINE_GRAPHS=1",
        "with `ENCORE_ENGINE_MATMUL=batched` on a CUDA device: each frame of the engine replays one CUDA graph that runs "
        "every slot over the whole cache, whichever slots are occupied (captured again only when the set of samplers "
        "or candidate sets in use changes, not when tracks join or leave); `0`: the frame's kernels launched one by one",
    )
    music_engine: str = setting(
        "ENCORE_MUSIC_ENGINE=torch",
        "transformer engine of the music stages: `torch` (plain PyTorch with a static KV cache, "
        "`app/pipeline/music/torch_engine.py`) or `megatron` (megatron-core's own forward, the reference); "
        "megatron-core loads the checkpoints either way",
    )
    preload_models: bool = flag(
        "ENCORE_PRELOAD=0", "`1`: each worker child loads its models before it takes jobs (what `/readyz` waits for)"
    )
    torch_threads: int = integer(
        "ENCORE_TORCH_THREADS=0", "CPU threads per worker child (0: torch's default)", ZERO_OR_MORE
    )

    # Jobs: what one may ask for, and their stages' limits, leases and heartbeats (docs/lifecycle.md)
    max_tracks: int = integer("ENCORE_MAX_TRACKS=4", "most tracks per music job", ONE_OR_MORE)
    max_lyrics_chars: int = integer("ENCORE_MAX_LYRICS_CHARS=8000", "lyrics size limit (characters)", ONE_OR_MORE)
    max_text_chars: int = integer("ENCORE_MAX_TEXT_CHARS=1000", "tags / prompt size limit (characters)", ONE_OR_MORE)
    time_limits: dict[str, tuple[float | None, float]] = setting(
        "ENCORE_TIME_LIMITS=",
        "per-stage `soft/hard` seconds over the defaults "
        f"`{DEFAULT_TIME_LIMITS}`, e.g. `backbone=1500/1560,decode=/600` (an empty soft: none)",
        parse=_time_limits_over_defaults,
    )
    max_deliveries: int = integer(
        "ENCORE_MAX_DELIVERIES=3",
        "a stage delivered (or restarted) more often than this, its worker dying each time, fails the track; its "
        "deaths count whoever noticed them (the next delivery or the reaper), and past this many in all the next one "
        "fails it too",
        ONE_OR_MORE,
    )
    max_retries: int = integer(
        "ENCORE_MAX_RETRIES=5",
        "most retries of one track through `POST /api/v1/jobs/<id>/retry` (403 naming `retries` past it; 0: none)",
        ZERO_OR_MORE,
    )
    cancel_grace_s: float = number(
        "ENCORE_CANCEL_GRACE_S=3",
        "after a cancel, how long a running stage may take to stop before its child is killed",
        ZERO_OR_MORE,
    )
    reroute_after_s: float = number(
        "ENCORE_REROUTE_AFTER_S=30",
        "move the open tracks of a queue whose every worker has been offline this long to live queues (0: never)",
        ZERO_OR_MORE,
    )
    lease_s: float = number(
        "ENCORE_LEASE_S=15",
        "a running stage's lease (renewed every third of it); a running track whose lease expired is started again "
        "from its first unfinished stage",
        ONE_OR_MORE,
    )
    stall_after_s: float = number(
        "ENCORE_STALL_AFTER_S=30",
        "a track waiting this long for a message that is in no broker list and not delivered gets it sent again",
        ABOVE_ZERO,
    )
    heartbeat_s: float = number(
        "ENCORE_HEARTBEAT_S=2", "worker heartbeat period; a worker is offline after about 3 missed beats", ABOVE_ZERO
    )
    result_expires_s: int = integer(
        f"ENCORE_RESULT_EXPIRES_S={24 * 3600}", "Celery result expiry (seconds)", ONE_OR_MORE
    )

    # The lip-sync pipeline (app/pipeline/lipsync/) and its uploads (app/http/uploads.py)
    lipsync_profile: str = setting(
        "ENCORE_LIPSYNC_PROFILE=tiny",
        "`tiny` (random weights), `shaped` (random weights, the tiny UNet with one attention head: the benches) or "
        "`musetalk` (real MuseTalk v1.5 weights)",
    )
    lipsync_model_dir: str | None = setting(
        "ENCORE_LIPSYNC_MODEL_DIR", "the MuseTalk layout (unset: `models/lipsync-<profile>`)"
    )
    lipsync_precision: str = setting(
        "ENCORE_LIPSYNC_PRECISION=auto",
        "MuseTalk's dtype: `auto` (fp16 on CUDA, fp32 on CPU), `fp16` or `fp32`; `fp16` on a CPU runs (about 2x "
        "slower than fp32 here) where its half kernels work, else the model load fails saying so",
        parse=_lower_case,
    )
    max_video_mb: float = number("ENCORE_MAX_VIDEO_MB=100", "face video upload limit (MB; 413 above it)", ABOVE_ZERO)
    max_audio_mb: float = number("ENCORE_MAX_AUDIO_MB=20", "driving audio upload limit (MB; 413 above it)", ABOVE_ZERO)
    min_video_s: float = number("ENCORE_MIN_VIDEO_S=3", "shortest face video (seconds; 400 below)", ZERO_OR_MORE)
    max_audio_s: float = number("ENCORE_MAX_AUDIO_S=600", "longest driving audio (seconds; 400 above)", ABOVE_ZERO)
    min_audio_s: float = number(
        "ENCORE_MIN_AUDIO_S=0.5",
        "shortest driving audio (seconds, never less than one output frame period; 400 below)",
        ZERO_OR_MORE,
    )
    max_video_pixels: int = integer(
        f"ENCORE_MAX_VIDEO_PIXELS={4096 * 2160}",
        "largest face video, width x height from ffprobe (4096x2160; 400 above, before any frame is decoded)",
        ONE_OR_MORE,
    )
    max_video_s: float = number(
        "ENCORE_MAX_VIDEO_S=300",
        "longest face video (seconds: its frames, counted from the packets, over its frame rate; 400 above)",
        ABOVE_ZERO,
    )
    max_scratch_mb: float = number(
        "ENCORE_MAX_SCRATCH_MB=16384",
        "most worker scratch for one lip-sync job's decoded source frames (MiB; the frames its output shows x width "
        "x height x 3): 400 at submit when the upload would pass it, and the stage fails saying so if decoding does",
        ONE_OR_MORE,
    )
    max_video_frame_pixels: int = integer(
        f"ENCORE_MAX_VIDEO_FRAME_PIXELS={300 * 30 * 1920 * 1080}",
        "most decoding work in one face video: frames x width x height (5 minutes of 30 fps 1080p; 400 above)",
        ONE_OR_MORE,
    )
    upload_dir: Path = directory("ENCORE_UPLOAD_DIR=var/uploads", "where uploads are staged while they are checked")
    ffmpeg_timeout_s: float = number(
        "ENCORE_FFMPEG_TIMEOUT_S=600", "timeout of each ffmpeg call in the lip-sync stages (seconds)", ABOVE_ZERO
    )
    ffmpeg: str = setting(
        "ENCORE_FFMPEG=ffmpeg", "the ffmpeg binary every media call runs, the music export's pydub included"
    )
    ffprobe: str = setting("ENCORE_FFPROBE=ffprobe", "the ffprobe binary every media call runs")
    lipsync_mask: str = setting(
        "ENCORE_LIPSYNC_MASK=jaw",
        "lip-sync blend mask: `jaw` (drawn from the 68 landmarks, as MuseTalk's 'jaw' parsing mode) or `rectangle` "
        "(the box's lower half; also whenever landmarks are missing)",
    )
    lipsync_path: str = setting(
        "ENCORE_LIPSYNC_PATH=device",
        "lip-sync's per-frame work: `device` (crops, resizes and blend as tensor ops on the model's device) or "
        "`reference` (OpenCV on the CPU, MuseTalk's own operations)",
    )
    face_threads: int = integer(
        "ENCORE_FACE_THREADS=0", "threads finding faces in the prepare stage; 0: one per core, at most 8", ZERO_OR_MORE
    )
    lipsync_cache_mb: float = number(
        "ENCORE_LIPSYNC_CACHE_MB=2048",
        "the per-source-video cache (faces and VAE latents of a face video) in "
        "`ENCORE_WORKER_CACHE_DIR/lipsync-sources`, in MiB, least recently used out; 0: off",
        ZERO_OR_MORE,
    )
    lipsync_warmup: bool = flag(
        "ENCORE_LIPSYNC_WARMUP=1", "with `ENCORE_PRELOAD=1`, one warm-up batch through MuseTalk at preload"
    )

    # Tenants and their tokens (app/core/tenants.py, docs/security.md), the Khala-compatible routes
    api_tokens: tuple[str, ...] = setting(
        "API_TOKEN=",
        "bearer token(s) required on `/api/*` and the Khala-compatible routes (a comma-separated list allowed); "
        "unset or empty: no auth; an empty entry (`,`, `a,,b`) refuses to start",
        parse=_api_tokens,
        secret=True,
    )
    admin_tokens: tuple[str, ...] = setting(
        "ENCORE_ADMIN_TOKENS=",
        "bearer tokens of the `admin` tenant (operator routes, every tenant's jobs), beside `API_TOKEN`'s client "
        "tenants ([security](security.md#tenants))",
        parse=_api_tokens,
        secret=True,
    )
    tenants_file: Path | None = setting(
        "ENCORE_TENANTS_FILE=",
        "a JSON file of tenants, their roles and their tokens' SHA-256 digests ([security](security.md#tenants)); "
        "unreadable or malformed: the web and the workers refuse to start",
        parse=_optional_path,
    )
    compat_prefix: str = setting(
        "ENCORE_COMPAT_PREFIX=",
        "URL prefix of the Khala-compatible routes (they are always under `/api` too)",
        parse=_url_path,
    )
    tags_file: Path | None = setting(
        "ENCORE_TAGS_FILE",
        "the tag catalogue served by `GET /tags` (unset: `app/http/khala_tags.json`)",
        parse=_optional_path,
    )

    # Operations: the worker's pinning, Flower (flowerconfig.py), the clients (app/clients/)
    cuda_visible_devices: str = setting(
        "CUDA_VISIBLE_DEVICES=",
        "set by `worker_entrypoint.sh`; shown as the worker's `pinned_to` in the registry and the cards its GPU "
        "readings cover (never read to pick a device)",
    )
    flower_basic_auth: str = setting(
        "ENCORE_FLOWER_BASIC_AUTH=",
        "Flower's `user:password[,...]` (unset: a random password is generated and printed)",
        parse=_stripped,
        secret=True,
    )
    flower_port: int = integer("ENCORE_FLOWER_PORT=5555", "Flower's port", Bounds(1, most=65535))
    flower_address: str = setting("ENCORE_FLOWER_ADDRESS=0.0.0.0", "Flower's bind address")
    flower_db: str = setting("ENCORE_FLOWER_DB=var/flower.db", "Flower's persistent state file")
    client_url: str = setting(f"ENCORE_URL={DEFAULT_WEB_URL}", "the CLI's (and the demo's) server")
    client_token: str | None = setting(
        "ENCORE_API_TOKEN", "the bearer token the CLI sends (the demo also sends `API_TOKEN`)", parse=_text_or_none
    )
    demo_web_url: str = setting(
        f"ENCORE_WEB_URL={DEFAULT_WEB_URL}", "where the demo looks for (or starts) the web server"
    )

    # The web server (gunicorn.conf.py) and event streams (app/http/events_server.py)
    web_bind: str = setting("ENCORE_WEB_BIND=0.0.0.0:8000", "the web server's bind address (`gunicorn.conf.py`)")
    web_workers: int = integer(
        "ENCORE_WEB_WORKERS=2", "gthread processes of the web server (compose runs 4)", ONE_OR_MORE
    )
    web_threads: int = integer(
        "ENCORE_WEB_THREADS=32",
        "threads per web process (an event stream the web serves itself holds one: at most half of them, and with "
        "tenants at most half of those for one tenant)",
        ONE_OR_MORE,
    )
    body_idle_s: float = number(
        "ENCORE_BODY_IDLE_S=30", "a request body that sends nothing this long is answered 408 and dropped", ABOVE_ZERO
    )
    sse_heartbeat_s: float = number(
        "ENCORE_SSE_HEARTBEAT_S=15",
        "a `: heartbeat` comment on an idle event stream this often (on the events server, also when a gone client "
        "is noticed)",
        ABOVE_ZERO,
    )
    sse_max_s: float = number(
        "ENCORE_SSE_MAX_S=3600",
        "the longest one event stream stays open (the client resumes with `Last-Event-ID`)",
        ABOVE_ZERO,
    )
    events_maxlen: int = integer(
        "ENCORE_EVENTS_MAXLEN=1000",
        "events kept per job for replay (the stream `encore:job:<id>:events`, expiring with the job)",
        ONE_OR_MORE,
    )
    events_bind: str = setting(
        "ENCORE_EVENTS_BIND=0.0.0.0:8001",
        "the events server's bind address (`python -m app events`: event streams on one asyncio loop)",
    )
    events_url: str = setting(
        "ENCORE_EVENTS_URL=",
        "the events server's public base URL, e.g. `http://events.example.com:8001`: the web answers `GET "
        "/api/v1/jobs/<id>/events` with a 307 there (a signed ticket in the query); unset: the web serves streams "
        "itself, at most half of `ENCORE_WEB_THREADS` per process (429 `streams` past it)",
        parse=_base_url,
    )
    max_streams_per_tenant: int = integer(
        "ENCORE_MAX_STREAMS_PER_TENANT=100",
        "most event streams one tenant holds open at once on the events servers (429 `streams` with `Retry-After` "
        "past it)",
        ONE_OR_MORE,
    )

    # Webhooks (app/adapters/webhooks.py) and tracing (app/adapters/tracing.py)
    webhook_secret: str = setting(
        "ENCORE_WEBHOOK_SECRET=",
        "Standard Webhooks signing secret (`whsec_` + base64); unset: a submit with a webhook is refused (400)",
        secret=True,
    )
    webhook_hosts: tuple[str, ...] = setting(
        "ENCORE_WEBHOOK_HOSTS=",
        "comma list of hosts a webhook may name (`.example.com`: it and its subdomains; `host:8443`: that port too, "
        "beside 80 and 443); unset: any public host",
        parse=_host_list,
    )
    webhook_allow_private: tuple[str, ...] = setting(
        "ENCORE_WEBHOOK_ALLOW_PRIVATE=",
        "comma list of non-public addresses or networks a webhook may reach (`10.0.0.0/8`; `127.0.0.1:8080`, "
        "`[::1]:8080`: that port only); unset: public addresses only",
        parse=_host_list,
    )
    webhook_queue: str = setting("ENCORE_WEBHOOK_QUEUE=webhooks", "the webhook worker's queue (never a GPU queue)")
    webhook_max_attempts: int = integer(
        "ENCORE_WEBHOOK_MAX_ATTEMPTS=8", "delivery attempts of one webhook", ONE_OR_MORE
    )
    webhook_backoff_s: float = number(
        "ENCORE_WEBHOOK_BACKOFF_S=1",
        "the shortest delay before a webhook's first retry: each retry waits a random time between its step of a "
        "doubling schedule from this and the next step (jitter, so that retries of many deliveries spread out)",
        ABOVE_ZERO,
    )
    webhook_backoff_cap_s: float = number(
        "ENCORE_WEBHOOK_BACKOFF_CAP_S=300", "the longest delay between two attempts", ABOVE_ZERO
    )
    webhook_timeout_s: float = number(
        "ENCORE_WEBHOOK_TIMEOUT_S=10", "one webhook request's timeout (seconds)", ABOVE_ZERO
    )
    webhook_history: int = integer("ENCORE_WEBHOOK_HISTORY=50", "delivery attempts kept in a job record", ONE_OR_MORE)
    webhook_progress_s: float = number(
        "ENCORE_WEBHOOK_PROGRESS_S=5", "least seconds between a job's progress webhooks", ZERO_OR_MORE
    )
    otel_endpoint: str = setting(
        "OTEL_EXPORTER_OTLP_ENDPOINT=",
        "OpenTelemetry tracing over OTLP/HTTP (`app/adapters/tracing.py`); unset: tracing off",
    )
    otel_service_name: str = setting("OTEL_SERVICE_NAME=encore", "spans come from `<name>-web` and `<name>-worker`")

    # Back-pressure (app/control/quotas.py, app/control/tenant_limits.py) and ETAs (app/control/eta.py)
    max_queued_tracks: int = integer(
        "ENCORE_MAX_QUEUED_TRACKS=0",
        "most open (not ended) tracks in all (0: no cap); a submit past it is 429 with `Retry-After` from the ETA, "
        "and not created",
        ZERO_OR_MORE,
    )
    max_queued_tracks_per_queue: int = integer(
        "ENCORE_MAX_QUEUED_TRACKS_PER_QUEUE=0",
        "most open tracks on each live GPU queue (0: no cap; a full queue takes no new track; 429 when none has room)",
        ZERO_OR_MORE,
    )
    submit_rate_limit: str = setting(
        f"ENCORE_SUBMIT_RATE_LIMIT={DEFAULT_SUBMIT_RATE_LIMIT}",
        "each tenant's rate limit of the submit routes together (per address where no token is configured), e.g. "
        "`10/minute;200/day` (429 with Retry-After past it); `off`: none; a tenants file may set a tenant's own",
        parse=_submit_rate,
    )
    tenant_max_open_tracks: int = integer(
        "ENCORE_TENANT_MAX_OPEN_TRACKS=200",
        "most open (not ended) tracks of one tenant at once (0: no cap); a submit past it is 429 `tracks` with "
        "Retry-After; a tenants file may set a tenant's own",
        ZERO_OR_MORE,
    )
    tenant_max_priority: str = setting(
        "ENCORE_TENANT_MAX_PRIORITY=normal",
        "the highest priority a client tenant's jobs may ask for (`low`, `normal` or `high`; admins may always use "
        "`high`); past it: 403 `priority`",
    )
    rate_limit_strategy: str = setting(
        "ENCORE_RATE_LIMIT_STRATEGY=fixed-window",
        "the rate limit's window: `fixed-window`, `moving-window` or `sliding-window-counter`",
    )
    eta_alpha: float = number(
        "ENCORE_ETA_ALPHA=0.3",
        "weight of a finished stage in its queue's learned seconds per cost unit (ETA, routing)",
        Bounds(0, least_allowed=False, most=1),
    )

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
        """Every numeric setting against its declared bounds, keyword overrides too."""
        for name, declared in declarations().items():
            if declared.bounds is not None:
                declared.bounds.check(declared.variable, getattr(self, name))

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


def load_settings() -> Settings:
    return Settings()
