"""The s3 artifact backend (issue 15, item 1) against a real S3 server (SeaweedFS, started by the
`s3_endpoint` fixture): round trip through the local cache, multipart uploads, expiry by explicit deletion
in the sweep, presigned URLs that honour Range, and a job through a real worker whose results the web serves
streamed and redirected."""

from __future__ import annotations

import hashlib
import uuid

import boto3
import pytest
import requests

from app.adapters.artifacts import S3Store
from app.core.ids import new_job_id
from harness.stack import S3_ENV


@pytest.fixture
def bucket(s3_endpoint):
    return boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="encore",
        aws_secret_access_key="encore-secret",
    )


def store(bucket, tmp_path, **kwargs) -> S3Store:
    return S3Store(bucket, "encore", f"test-{uuid.uuid4().hex[:8]}/", tmp_path / "cache", **kwargs)


def test_files_round_trip_through_the_bucket_and_the_local_cache(bucket, tmp_path):
    artifacts = store(bucket, tmp_path)
    job_id = new_job_id()
    source = tmp_path / "track0.wav"
    source.write_bytes(b"RIFF" + bytes(range(256)) * 100)
    assert not artifacts.exists(job_id, "track0.wav")
    artifacts.put(job_id, "track0.wav", source, 60)
    assert artifacts.exists(job_id, "track0.wav")
    head = bucket.head_object(Bucket="encore", Key=f"{artifacts.prefix}{job_id}/track0.wav")
    assert head["ContentLength"] == source.stat().st_size
    local = artifacts.local_path(job_id, "track0.wav")
    assert local.read_bytes() == source.read_bytes() and local.is_relative_to(tmp_path / "cache")
    with pytest.raises(FileNotFoundError):
        artifacts.local_path(job_id, "missing.wav")
    with pytest.raises(ValueError):
        artifacts.put(job_id, "../escape", source, 60)
    artifacts.delete_job(job_id)
    assert not artifacts.exists(job_id, "track0.wav") and not local.exists()


def test_a_large_file_goes_up_in_parts(bucket, tmp_path):
    artifacts = store(bucket, tmp_path, multipart_bytes=5 << 20)  # S3's smallest part
    job_id = new_job_id()
    source = tmp_path / "output.mp4"
    payload = hashlib.sha256(b"seed").digest() * ((12 << 20) // 32)  # 12 MiB
    source.write_bytes(payload)
    artifacts.put(job_id, "output.mp4", source, 60)
    etag = bucket.head_object(Bucket="encore", Key=f"{artifacts.prefix}{job_id}/output.mp4")["ETag"].strip('"')
    assert etag.endswith("-3")  # a multipart upload's ETag counts its parts: 5 + 5 + 2 MiB
    assert artifacts.local_path(job_id, "output.mp4").read_bytes() == payload


def test_the_sweep_deletes_the_objects_of_expired_jobs_only(bucket, tmp_path):
    artifacts = store(bucket, tmp_path)
    kept, gone = new_job_id(), new_job_id()
    source = tmp_path / "f.bin"
    source.write_bytes(b"x" * 1000)
    for job_id in (kept, gone):
        for name in ("a.bin", "b.bin"):
            artifacts.put(job_id, name, source, 60)
        artifacts.local_path(job_id, "a.bin")  # a cached copy too
    removed = artifacts.sweep(lambda job_id: job_id == kept)
    assert gone in removed and kept not in removed
    assert artifacts.exists(kept, "a.bin") and artifacts.exists(kept, "b.bin")
    assert not artifacts.exists(gone, "a.bin") and not artifacts.exists(gone, "b.bin")
    assert not (tmp_path / "cache" / gone).exists() and (tmp_path / "cache" / kept / "a.bin").exists()


def test_a_presigned_url_serves_the_object_and_its_ranges(bucket, tmp_path):
    job_id = new_job_id()
    source = tmp_path / "track0.mp3"
    source.write_bytes(bytes(range(200)))
    assert store(bucket, tmp_path).presigned_url(job_id, "track0.mp3", "x.mp3") is None  # presigning off
    artifacts = store(bucket, tmp_path, presign_s=60)
    artifacts.put(job_id, "track0.mp3", source, 60)
    url = artifacts.presigned_url(job_id, "track0.mp3", "encore-track0.mp3")
    whole = requests.get(url, timeout=10)
    assert whole.status_code == 200 and whole.content == source.read_bytes()
    part = requests.get(url, headers={"Range": "bytes=10-19"}, timeout=10)
    assert part.status_code == 206 and part.content == bytes(range(10, 20))
    assert requests.get(url.replace("track0.mp3", "track1.mp3"), timeout=10).status_code in (403, 404)


@pytest.mark.slow  # a job on a worker over S3 (~10 s here)
def test_a_job_on_the_s3_backend_is_served_streamed_and_presigned(make_stack, s3_endpoint, bucket):
    prefix = f"stack-{uuid.uuid4().hex[:8]}/"
    env = {**S3_ENV, "ENCORE_S3_ENDPOINT": s3_endpoint, "ENCORE_S3_PREFIX": prefix}
    stack = make_stack(**env)
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=2.0)
    assert stack.wait_job(job_id, timeout=120)["state"] == "done"
    keys = {item["Key"] for item in bucket.list_objects_v2(Bucket="encore", Prefix=f"{prefix}{job_id}/")["Contents"]}
    assert {f"{prefix}{job_id}/track0.mp3", f"{prefix}{job_id}/track0.wav"} <= keys
    assert not (stack.root / "artifacts").exists()  # nothing in the shared-directory backend
    stored = bucket.get_object(Bucket="encore", Key=f"{prefix}{job_id}/track0.mp3")["Body"].read()
    streamed = stack.client.get(f"/api/v1/jobs/{job_id}/tracks/0.mp3")
    assert streamed.status_code == 200 and streamed.data == stored
    ranged = stack.client.get(f"/api/v1/jobs/{job_id}/tracks/0.mp3", headers={"Range": "bytes=0-99"})
    assert ranged.status_code == 206 and ranged.data == stored[:100]

    presigning = make_stack(**env, ENCORE_S3_PRESIGN="1", ENCORE_S3_PRESIGN_S="120")
    presigning.redis.flushdb()
    for key in stack.redis.keys("*"):  # the same records, read by a web that presigns
        presigning.redis.restore(key, 0, stack.redis.dump(key), replace=True)
    reply = presigning.client.get(f"/api/v1/jobs/{job_id}/tracks/0.mp3")
    assert reply.status_code == 302 and reply.headers["Location"].startswith(s3_endpoint)
    part = requests.get(reply.headers["Location"], headers={"Range": "bytes=100-199"}, timeout=10)
    assert part.status_code == 206 and part.content == stored[100:200]
