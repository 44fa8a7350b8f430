"""Artifact store: where stages leave intermediates and results, addressed by (job id, file name).

Three backends behind one interface:
- `DirectoryStore` (default): a directory every worker and the web can see (a shared volume).
- `RedisStore`: files chunked into Redis lists that expire with the job, for workers on hosts without a
  shared filesystem. Readers get a local copy in a cache directory, fetched a few chunks per round trip.
- `S3Store`: objects in an S3-compatible bucket (AWS, MinIO, SeaweedFS, ...) through boto3, for hosts that
  share nothing but Redis and the bucket. Large files go up in multipart uploads (boto3's transfer manager);
  readers keep a local copy in a cache directory; objects are deleted explicitly once their job's record has
  expired (the workers' periodic sweep lists the job prefixes and removes those of gone jobs: no bucket
  lifecycle rule is needed, and none is assumed). Downloads can be handed out as presigned URLs.
The two remote stores share their read path (`CachedStore`: the local copy, fetched when missing).
Names are validated so a download can never escape the store.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Callable, Protocol, cast

import redis

from app.core.ids import is_job_id
from app.core.keys import Layout

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
CHUNK_BYTES = 1 << 20
# Chunks fetched per round trip by a RedisStore reader (so at most 4 MiB held at once). Larger batches save
# round trips but cost client time per MiB: measured by bench/artifact_reads.py, break-even near 0.4 ms RTT.
READ_BATCH_CHUNKS = 4


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
    def presigned_url(self, job_id: str, name: str, filename: str) -> str | None: ...


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

    def presigned_url(self, job_id: str, name: str, filename: str) -> str | None:
        return None  # served by the web itself

    def sweep(self, job_exists: Callable[[str], bool]) -> list[str]:
        removed = []
        if self.root.is_dir():
            for folder in self.root.iterdir():
                if folder.is_dir() and is_job_id(folder.name) and not job_exists(folder.name):
                    shutil.rmtree(folder, ignore_errors=True)
                    removed.append(folder.name)
        return removed


class CachedStore:
    """The read path of a store whose files live elsewhere: `local_path` gives the copy in a local cache
    directory, fetched first when missing. A subclass says how to fetch (`_fetch`) and sets `cache`."""

    cache: DirectoryStore

    def local_path(self, job_id: str, name: str) -> Path:
        """The cached copy, fetched first when missing (FileNotFoundError when the stored file is)."""
        check_name(job_id, name)
        cached = self.cache.root / job_id / name
        if cached.is_file():
            return cached
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f".{name}.{time.monotonic_ns()}.partial")  # readers never see it half-written
        try:
            self._fetch(job_id, name, partial)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        partial.replace(cached)
        return cached

    def _fetch(self, job_id: str, name: str, target: Path) -> None:
        """Write the stored file to `target`; FileNotFoundError when there is none."""
        raise NotImplementedError


class RedisStore(CachedStore):
    """Files as Redis lists of 1 MiB chunks that expire with their job; reads go through a local cache."""

    def __init__(self, client: redis.Redis, prefix: str, cache_dir: Path, read_batch_chunks: int = READ_BATCH_CHUNKS):
        self.redis = client
        self.prefix = prefix
        self.layout = Layout(prefix)
        self.cache = DirectoryStore(cache_dir)
        self.read_batch_chunks = max(1, read_batch_chunks)

    def _key(self, job_id: str, name: str) -> str:
        check_name(job_id, name)
        return self.layout.artifact(job_id, name)

    def _index_key(self, job_id: str) -> str:
        return self.layout.artifact_index(job_id)

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

    def _fetch(self, job_id: str, name: str, target: Path) -> None:
        """`read_batch_chunks` chunks per LRANGE, until a batch comes back short: a stored file has at least one
        chunk (an empty file one empty chunk), so none at all means there is no such file (or it expired)."""
        key, batch = self._key(job_id, name), self.read_batch_chunks
        start = 0
        with open(target, "wb") as handle:
            while True:
                chunks = cast(list[bytes], self.redis.lrange(key, start, start + batch - 1))  # a bytes client
                handle.writelines(chunks)
                start += len(chunks)
                if len(chunks) < batch:
                    break
        if start == 0:
            raise FileNotFoundError(f"{job_id}/{name}")

    def delete_job(self, job_id: str) -> None:
        names = self.redis.smembers(self._index_key(job_id))
        keys = [self._key(job_id, n.decode() if isinstance(n, bytes) else n) for n in names]
        self.redis.delete(self._index_key(job_id), *keys)
        self.cache.delete_job(job_id)

    def sweep(self, job_exists: Callable[[str], bool]) -> list[str]:
        """Redis expires the chunks itself; only the local cache needs sweeping."""
        return self.cache.sweep(job_exists)

    def presigned_url(self, job_id: str, name: str, filename: str) -> str | None:
        return None


class S3Store(CachedStore):
    """Objects <prefix><job id>/<name> in one bucket; reads go through a local cache directory."""

    def __init__(
        self, client, bucket: str, prefix: str, cache_dir: Path, presign_s: int = 0, multipart_bytes: int = 8 << 20
    ):
        from boto3.s3.transfer import TransferConfig

        self.s3, self.bucket = client, bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.cache = DirectoryStore(cache_dir)
        self.presign_s = presign_s
        self.transfer = TransferConfig(multipart_threshold=multipart_bytes, multipart_chunksize=multipart_bytes)

    def _key(self, job_id: str, name: str) -> str:
        check_name(job_id, name)
        return f"{self.prefix}{job_id}/{name}"

    def put(self, job_id: str, name: str, source: Path, ttl_s: float = 0) -> None:
        """Upload (multipart above the threshold); S3 makes an object visible only once it is complete."""
        self.s3.upload_file(str(source), self.bucket, self._key(job_id, name), Config=self.transfer)

    def exists(self, job_id: str, name: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.s3.head_object(Bucket=self.bucket, Key=self._key(job_id, name))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def _fetch(self, job_id: str, name: str, target: Path) -> None:
        """Download the object (multipart above the threshold)."""
        from botocore.exceptions import ClientError

        try:
            self.s3.download_file(self.bucket, self._key(job_id, name), str(target), Config=self.transfer)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(f"{job_id}/{name}") from None
            raise

    def _job_keys(self, job_id: str) -> list[str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{self.prefix}{job_id}/")
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def delete_job(self, job_id: str) -> None:
        if not is_job_id(job_id):
            return
        keys = self._job_keys(job_id)
        for first in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            self.s3.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[first : first + 1000]], "Quiet": True}
            )
        self.cache.delete_job(job_id)

    def sweep(self, job_exists: Callable[[str], bool]) -> list[str]:
        """Delete the objects (and cached copies) of every job whose record has expired."""
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix, Delimiter="/")
        removed = []
        for page in pages:
            for common in page.get("CommonPrefixes", []):
                job_id = common["Prefix"][len(self.prefix) :].rstrip("/")
                if is_job_id(job_id) and not job_exists(job_id):
                    self.delete_job(job_id)
                    removed.append(job_id)
        return removed + self.cache.sweep(job_exists)

    def presigned_url(self, job_id: str, name: str, filename: str) -> str | None:
        """A time-limited GET URL of the object (S3 itself then honours Range), or None when presigning is off."""
        if not self.presign_s:
            return None
        return self.s3.generate_presigned_url(
            "get_object",
            ExpiresIn=self.presign_s,
            Params={
                "Bucket": self.bucket,
                "Key": self._key(job_id, name),
                "ResponseContentDisposition": f'attachment; filename="{filename}"',
            },
        )


def s3_client(settings):
    """boto3's S3 client for ENCORE_S3_ENDPOINT with the settings' AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY,
    or without them boto3's own chain (a profile, an instance role)."""
    import boto3
    from botocore.config import Config

    keys = (
        {"aws_access_key_id": settings.s3_access_key, "aws_secret_access_key": settings.s3_secret_key}
        if settings.s3_access_key
        else {}
    )
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint or None,
        region_name=settings.s3_region,
        **keys,
        config=Config(
            signature_version="s3v4", retries={"max_attempts": 5, "mode": "standard"}, s3={"addressing_style": "path"}
        ),
    )


def open_store(settings, binary_client: redis.Redis) -> ArtifactStore:
    """The configured backend. `binary_client` must not decode responses (chunks are bytes)."""
    if settings.artifact_backend == "redis":
        return RedisStore(binary_client, settings.key_prefix, settings.worker_cache_dir / "artifacts")
    if settings.artifact_backend == "s3":
        return S3Store(
            s3_client(settings),
            settings.s3_bucket,
            settings.s3_prefix,
            settings.worker_cache_dir / "artifacts",
            presign_s=settings.s3_presign_s,
        )
    return DirectoryStore(settings.artifact_dir)
