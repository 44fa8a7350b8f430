"""Artifact store: where stages leave intermediates and results, addressed by (job id, file name).

Two backends behind one interface:
- `DirectoryStore` (default): a directory every worker and the web can see (a shared volume).
- `RedisStore`: files chunked into Redis lists that expire with the job, for workers on hosts without a
  shared filesystem. Readers get a local copy in a cache directory.
Names are validated so a download can never escape the store.
"""
from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Callable, Protocol

import redis

from app.jobs import is_job_id

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
CHUNK_BYTES = 1 << 20


def check_name(job_id: str, name: str) -> None:
    if not is_job_id(job_id):
        raise ValueError(f"invalid job id {job_id!r}")
    if not NAME_PATTERN.match(name) or ".." in name:
        raise ValueError(f"invalid artifact name {name!r}")


class ArtifactStore(Protocol):
    def put(self, job_id: str, name: str, source: Path, ttl_s: float) -> None: ...
    def exists(self, job_id: str, name: str) -> bool: ...
    def local_path(self, job_id: str, name: str) -> Path: ...
    def delete_job(self, job_id: str) -> None: ...
    def sweep(self, job_exists: Callable[[str], bool]) -> list[str]: ...


class DirectoryStore:
    """Files under root/<job id>/<name>; a sweep deletes folders whose job record has expired."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, job_id: str, name: str) -> Path:
        check_name(job_id, name)
        return self.root / job_id / name

    def put(self, job_id: str, name: str, source: Path, ttl_s: float = 0) -> None:
        target = self._path(job_id, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{name}.partial")
        shutil.copyfile(source, partial)
        partial.replace(target)  # readers never see a half-written file

    def exists(self, job_id: str, name: str) -> bool:
        return self._path(job_id, name).is_file()

    def local_path(self, job_id: str, name: str) -> Path:
        path = self._path(job_id, name)
        if not path.is_file():
            raise FileNotFoundError(f"{job_id}/{name}")
        return path

    def delete_job(self, job_id: str) -> None:
        if is_job_id(job_id):
            shutil.rmtree(self.root / job_id, ignore_errors=True)

    def sweep(self, job_exists: Callable[[str], bool]) -> list[str]:
        removed = []
        if self.root.is_dir():
            for folder in self.root.iterdir():
                if folder.is_dir() and is_job_id(folder.name) and not job_exists(folder.name):
                    shutil.rmtree(folder, ignore_errors=True)
                    removed.append(folder.name)
        return removed


class RedisStore:
    """Files as Redis lists of 1 MiB chunks that expire with their job; reads go through a local cache."""

    def __init__(self, client: redis.Redis, prefix: str, cache_dir: Path):
        self.redis = client
        self.prefix = prefix
        self.cache = DirectoryStore(cache_dir)

    def _key(self, job_id: str, name: str) -> str:
        check_name(job_id, name)
        return f"{self.prefix}:artifact:{job_id}:{name}"

    def _index_key(self, job_id: str) -> str:
        return f"{self.prefix}:artifacts:{job_id}"

    def put(self, job_id: str, name: str, source: Path, ttl_s: float) -> None:
        key, staging = self._key(job_id, name), self._key(job_id, name) + ":partial"
        ttl = max(1, int(ttl_s))
        self.redis.delete(staging)
        with open(source, "rb") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                self.redis.rpush(staging, chunk)
        if not self.redis.exists(staging):
            self.redis.rpush(staging, b"")
        pipe = self.redis.pipeline()
        pipe.rename(staging, key)
        pipe.expire(key, ttl)
        pipe.sadd(self._index_key(job_id), name)
        pipe.expire(self._index_key(job_id), ttl)
        pipe.execute()

    def exists(self, job_id: str, name: str) -> bool:
        return bool(self.redis.exists(self._key(job_id, name)))

    def local_path(self, job_id: str, name: str) -> Path:
        key = self._key(job_id, name)
        cached = self.cache.root / job_id / name
        if cached.is_file():
            return cached
        if not self.redis.exists(key):
            raise FileNotFoundError(f"{job_id}/{name}")
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f".{name}.{time.monotonic_ns()}.partial")
        with open(partial, "wb") as handle:
            for index in range(self.redis.llen(key)):
                handle.write(self.redis.lindex(key, index))
        partial.replace(cached)
        return cached

    def delete_job(self, job_id: str) -> None:
        names = self.redis.smembers(self._index_key(job_id))
        keys = [self._key(job_id, n.decode() if isinstance(n, bytes) else n) for n in names]
        self.redis.delete(self._index_key(job_id), *keys)
        self.cache.delete_job(job_id)

    def sweep(self, job_exists: Callable[[str], bool]) -> list[str]:
        """Redis expires the chunks itself; only the local cache needs sweeping."""
        return self.cache.sweep(job_exists)


def open_store(settings, binary_client: redis.Redis) -> ArtifactStore:
    """The configured backend. `binary_client` must not decode responses (chunks are bytes)."""
    if settings.artifact_backend == "redis":
        return RedisStore(binary_client, settings.key_prefix, settings.worker_cache_dir / "artifacts")
    return DirectoryStore(settings.artifact_dir)
