"""docker-compose.yml is valid (Debian's docker-compose parses it; no engine needed) and deploys what the
project actually has: every command it runs exists here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from harness.processes import REPO

SECRETS = {"REDIS_PASSWORD": "s3cret-redis", "ENCORE_FLOWER_BASIC_AUTH": "ops:pw", "API_TOKEN": "tok"}


def compose_config(env: dict[str, str]) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is not installed (scripts/setup.sh --test installs Debian's package)"
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    return subprocess.run(
        [binary, "-f", str(REPO / "docker-compose.yml"), "config"],
        cwd=REPO,
        env={**clean, **env},
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_file_is_valid_and_secure_by_default():
    missing = compose_config({})
    assert missing.returncode != 0 and "REDIS_PASSWORD" in missing.stderr
    result = compose_config(SECRETS)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert set(services) == {
        "redis",
        "web",
        "events",
        "flower",
        "webhooks",
        "worker-gpu0",
        "worker-gpu1",
        "seaweedfs",
    }
    # Event streams go to the events service (a 307 from the web), which shares the web's Redis and tenants.
    assert services["events"]["command"] == ["python", "-m", "app", "events", "--bind", "0.0.0.0:8001"]
    assert services["web"]["environment"]["ENCORE_EVENTS_URL"] == "http://localhost:8001"
    assert services["events"]["environment"]["API_TOKEN"] == services["web"]["environment"]["API_TOKEN"]
    assert services["seaweedfs"]["profiles"] == ["s3"]  # the object store only with --profile s3
    assert services["web"]["environment"]["ENCORE_ARTIFACT_BACKEND"] == "dir"  # unless s3 is asked for
    webhooks = services["webhooks"]["command"]
    assert webhooks[webhooks.index("-Q") + 1] == "webhooks" and "deploy" not in services["webhooks"]  # no GPU
    redis_cmd = services["redis"]["command"]
    assert "--appendonly" in redis_cmd and redis_cmd[redis_cmd.index("--requirepass") + 1] == "s3cret-redis"
    for name in ("web", "events", "flower", "webhooks", "worker-gpu0", "worker-gpu1"):
        env = services[name]["environment"]
        assert env["REDIS_URL"] == "redis://:s3cret-redis@redis:6379/0"
        assert any(
            v["target"] == "/data" if isinstance(v, dict) else v.endswith(":/data:rw")
            for v in services[name]["volumes"]
        ), name
    assert services["flower"]["environment"]["ENCORE_FLOWER_BASIC_AUTH"] == "ops:pw"
    for gpu in (0, 1):
        worker = services[f"worker-gpu{gpu}"]
        assert worker["command"] == ["./worker_entrypoint.sh", str(gpu)]
        devices = worker["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["device_ids"] == [str(gpu)] and devices[0]["capabilities"] == ["gpu"]
        assert worker["environment"]["ENCORE_PIN_DEVICE"] == "0"


def test_every_command_in_the_compose_file_exists_in_the_project():
    services = yaml.safe_load(compose_config(SECRETS).stdout)["services"]
    venv_bin = Path(sys.executable).parent
    for name, service in services.items():
        if name in ("redis", "seaweedfs"):
            continue  # the official redis and SeaweedFS images
        program = service["command"][0]
        if program.startswith("./"):
            script = REPO / program[2:]
            assert script.is_file() and os.access(script, os.X_OK), f"{name}: {program} missing"
        else:
            assert (venv_bin / program).exists(), f"{name}: {program} is not installed by requirements.txt"
        assert (REPO / service["build"]["context"]).resolve() == REPO
    assert services["web"]["command"] == ["gunicorn", "-c", "gunicorn.conf.py"]
    assert services["web"]["environment"]["ENCORE_WEB_WORKERS"] == "4"
    from app.web import create_app  # what gunicorn will call

    assert callable(create_app)
    assert (REPO / "flowerconfig.py").is_file()
    dockerfile = (REPO / "Dockerfile").read_text()
    for source in ("requirements.txt", "requirements.lock", "scripts/disable_torchaudio_ext.py"):
        assert source in dockerfile and (REPO / source).exists()


def test_the_demo_the_image_and_compose_serve_with_one_gunicorn_conf():
    """gunicorn.conf.py names the app and the gthread worker; gunicorn itself loads it and the app."""
    config = {}
    exec(compile((REPO / "gunicorn.conf.py").read_text(), "gunicorn.conf.py", "exec"), config)
    assert (
        config["wsgi_app"] == "app.web:create_app()"
        and config["worker_class"] == "app.http.server_errors.JsonErrorThreadWorker"
    )
    assert config["threads"] >= 16 and config["workers"] >= 2
    assert 'CMD ["gunicorn", "-c", "gunicorn.conf.py"]' in (REPO / "Dockerfile").read_text()
    assert '"gunicorn", "-c", "gunicorn.conf.py"' in (REPO / "app" / "clients" / "demo.py").read_text()
    checked = subprocess.run(
        [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "--check-config"],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stderr[-2000:]
