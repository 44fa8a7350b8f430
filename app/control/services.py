"""The shared handles every process needs (Redis clients, job store, worker registry, artifact store, and the
ffmpeg/ffprobe the pipeline's media calls are given)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import redis

from app.adapters.artifacts import ArtifactStore, open_store
from app.core.config import Settings, load_settings
from app.control.jobs import JobStore
from app.pipeline.media.ffmpeg import MediaTools
from app.adapters.redis_conn import redis_client
from app.control.workers import WorkerRegistry, offline_after_s


@dataclass
class Services:
    settings: Settings
    redis: redis.Redis
    jobs: JobStore
    workers: WorkerRegistry
    artifacts: ArtifactStore
    media: MediaTools  # ENCORE_FFMPEG / ENCORE_FFPROBE, handed to every pipeline call that runs them


def build_services(settings: Settings) -> Services:
    text_client = redis_client(settings, decode_responses=True)
    bytes_client = redis_client(settings, decode_responses=False)
    return Services(
        settings=settings,
        redis=text_client,
        jobs=JobStore(
            text_client,
            settings.key_prefix,
            settings.job_ttl_s,
            settings.events_maxlen,
            settings.webhook_progress_s,
            offline_after_s(settings.heartbeat_s),
        ),
        workers=WorkerRegistry(text_client, settings.key_prefix, settings.heartbeat_s),
        artifacts=open_store(settings, bytes_client),
        media=MediaTools.of(settings),
    )


@lru_cache(maxsize=1)
def services() -> Services:
    """Per-process singleton built from the environment."""
    return build_services(load_settings())
