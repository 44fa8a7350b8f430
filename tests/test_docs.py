"""The docs say what the code does: the configuration table is what scripts/config_table.py prints from the
settings module; every relative link (and every repository path in backticks) names a file that exists; and
every shell example (a ```bash or ```sh block in README.md or docs/*.md) runs against a real stack (a
redis-server, the worker the docs themselves start, gunicorn, the servers the examples start) and prints what
it should. Blocks that are not commands are ```text; the few commands CI cannot run are listed in NOT_RUN with
the reason."""

from __future__ import annotations

import ast
import base64
import importlib.util
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from harness.processes import REPO, free_port, wait_until
from harness.stack import Stack

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Files other branches write, linked before they land: allowed to be missing until then (drop them once merged).
PENDING_FILES: dict[str, str] = {}
ENDED = ("done", "failed", "canceled", "partial")


def _config_table():
    spec = importlib.util.spec_from_file_location("config_table", REPO / "scripts" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


config_table = _config_table()


# -- the configuration table --------------------------------------------------------------------------------------
def test_the_configuration_table_is_what_the_generator_prints():
    documented = config_table.generated_block(config_table.DOC.read_text(encoding="utf-8"))
    assert documented == config_table.table(), "docs/configuration.md is stale: python scripts/config_table.py --write"


def test_the_table_names_every_variable_the_settings_module_reads():
    """A check of the generator by other means: every variable named in the settings module's source (a string that
    is a variable's name, or its `NAME=default` declaration, MODEL_PATH_VARIABLES' values and names passed to a
    check included) is in the table, and nothing else is."""
    tree = ast.parse(Path(config_table.settings_module().__file__).read_text(encoding="utf-8"))
    strings = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    named = (re.fullmatch(r"([A-Z][A-Z0-9]*_[A-Z0-9_]+)(=.*)?", text, re.S) for text in strings)
    read = {match[1] for match in named if match}
    in_table = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", "\n".join(row[0] for row in config_table.rows())))
    assert read and read == in_table, (read - in_table, in_table - read)


def test_the_check_option_fails_on_a_stale_table(tmp_path):
    doc = tmp_path / "configuration.md"
    text = config_table.DOC.read_text(encoding="utf-8")
    doc.write_text(text.replace("| `REDIS_URL` |", "| `REDIS_URI` |", 1), encoding="utf-8")
    assert config_table.check(doc) == 1
    config_table.write(doc)
    assert config_table.check(doc) == 0 and doc.read_text(encoding="utf-8") == text


# -- links and paths ----------------------------------------------------------------------------------------------
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
REPO_PATH = re.compile(
    r"`((?:app|tests|scripts|bench|docs)/[\w./-]*\w\.(?:py|sh|json|md|toml|yml|lua)"
    r"|[\w-]+\.(?:py|sh|yml|toml))`"
)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens kept), spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (match := HEADING.match(line)):
            found.add(slug(match.group(1)))
    return found


def test_every_relative_link_points_at_a_file_and_a_heading_that_exist():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(_outside_code(doc.read_text(encoding="utf-8"))):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not ours to check here
            name, _, anchor = target.partition("#")
            path = (doc.parent / name).resolve() if name else doc
            relative = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)
            if not path.exists():
                if relative not in PENDING_FILES:
                    broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _exists(name: str) -> bool:
    """A path from the repository root; a bare file name (`stage.py` in the text about app/tasks/) anywhere."""
    if (REPO / name).exists() or name in PENDING_FILES:
        return True
    return "/" not in name and any(next(REPO.glob(f"{top}/**/{name}"), None) for top in ("app", "tests", "bench"))


def test_every_repository_path_in_backticks_exists():
    missing = sorted(
        {
            f"{doc.relative_to(REPO)}: {name}"
            for doc in DOCS
            for name in REPO_PATH.findall(doc.read_text(encoding="utf-8"))
            if not _exists(name)
        }
    )
    assert not missing, "\n".join(missing)


def _outside_code(text: str) -> str:
    """The text without fenced blocks and inline code (a link written inside code is not a link)."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"(?ms)^\s*```.*?^\s*```", "", text))


# -- the shell examples -------------------------------------------------------------------------------------------
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[\w+-]*)[ \t]*$")
RUNNABLE = ("bash", "sh")


@dataclass(frozen=True)
class Block:
    doc: str  # path relative to the repository
    line: int  # of the opening fence
    info: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        lines = doc.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            opening = FENCE.match(lines[i])
            if not opening:
                i += 1
                continue
            indent, body, j = opening["indent"], [], i + 1
            while j < len(lines) and lines[j].strip() != "```":
                body.append(lines[j].removeprefix(indent))
                j += 1
            found.append(Block(doc.relative_to(REPO).as_posix(), i + 1, opening["info"], "\n".join(body) + "\n"))
            i = j + 1
    return found


@dataclass(frozen=True)
class Example:
    """What one runnable block must do. `key` is a piece of its text that no other runnable block has."""

    doc: str
    key: str
    expect: tuple[str, ...] = ()  # regexes its output (stdout + stderr) must match
    files: dict[str, bytes] = field(default_factory=dict)  # files it leaves in its folder: name -> leading bytes
    job: str = "music"  # what JOB_ID names: a finished job of this fixture
    url: str = "web"  # the server ENCORE_URL names
    server: str | None = None  # a long-running command: started under this name, kept
    then: str = ""  # Python run after it in its environment (exports)
    timeout_s: float = 240

    @property
    def name(self) -> str:
        return f"{self.doc}[{self.server or self.key[:40]}]"


SETTINGS = config_table.SETTINGS_MODULE
JSON_ID = r'"job_id":\s*"[0-9a-f]{32}"'
MP3 = b"ID3"
MP4_AT_4 = b"ftyp"  # checked from byte 4 (see _leading)

EXAMPLES = [
    # docs/deployment.md: the worker every other example talks to is started by the docs' own command
    Example(
        "docs/deployment.md",
        "./worker_entrypoint.sh 0",
        server="worker",
        expect=(r"\[queues\][\s\S]*gpu0", r"gpu0@\S+ ready\."),
    ),
    Example(
        "docs/deployment.md",
        "ENCORE_ARTIFACT_BACKEND=s3 ENCORE_S3_ENDPOINT",
        then=f"import {SETTINGS} as c; s = c.load_settings(); "
        "print('s3:', s.artifact_backend, s.s3_endpoint, s.s3_bucket, s.s3_prefix, s.s3_presign_s)",
        expect=(r"s3: s3 http://minio\.internal:9000 encore artifacts/ 900",),
    ),
    Example(
        "docs/deployment.md",
        "REDIS_SENTINELS=10.0.0.11",
        then=f"import {SETTINGS} as c; s = c.load_settings(); "
        "print('sentinel:', s.redis_sentinels, s.redis_sentinel_master, s.redis_url)",
        expect=(
            (
                r"sentinel: \(\('10\.0\.0\.11', 26379\), \('10\.0\.0\.12', 26379\), \('10\.0\.0\.13', 26379\)\) "
                r"encore-primary redis://:primary-password@unused/0"
            ),
        ),
    ),
    # docs/api.md
    Example(
        "docs/api.md",
        '"mode": "vocal", "tags": "synthpop, female vocal"',
        expect=(
            JSON_ID,
            r'"eta_s":',
            r'"state":\s*"done"',
            r'"workers":',
            r'"draining":\s*true',
            r'"draining":\s*false',
            r'"redis":\s*"ok"',
            r'"ready":\s*true',
        ),
        files={"t0.mp3": MP3, "t0.wav": b"RIFF"},
    ),
    Example(
        "docs/api.md",
        "curl -sNL $ENCORE_URL/api/v1/jobs/$JOB_ID/events\n",
        expect=(r'"event":\s*"submit"', r'"event":\s*"finish"', r"event: end\ndata: \{[^}]*\"state\":\s*\"done\""),
    ),
    Example(
        "docs/api.md",
        "Idempotency-Key: order-4711",
        expect=(
            JSON_ID,
            r"(?i)Idempotent-Replayed: true",
            r'"field":\s*"Idempotency-Key"',
            r'"error":\s*"Idempotency-Key: already used with a different request body"',
        ),
    ),
    Example(
        "docs/api.md",
        "curl -s $ENCORE_URL/api/v1/usage",
        expect=(r'"tenant":\s*"default"', r'"jobs":\s*[1-9]', r'"gpu_seconds":\s*[0-9.]*[1-9]'),
    ),
    Example("docs/api.md", '"webhook": "https://hooks.example.com/encore"', expect=(JSON_ID + r"[\s\S]*" + JSON_ID,)),
    Example(
        "docs/api.md", "celery -A app worker -Q webhooks", server="webhooks", expect=(r"\[queues\][\s\S]*webhooks",)
    ),
    Example(
        "docs/api.md",
        '"duration_s": 30, "priority": "high"',
        expect=(JSON_ID + r"[\s\S]*" + JSON_ID, r'"priority":\s*"normal"', r"submitted job [0-9a-f]{8}"),
    ),
    Example("docs/api.md", "/api/v1/jobs/$JOB_ID/retry", job="canceled", expect=(r'"retried":\s*\[0\]',)),
    Example("docs/api.md", '"tags": "lo-fi", "duration_s": 60}', expect=(r'"eta_s":\s*\d', r'"state":\s*"done"')),
    Example("docs/api.md", "ENCORE_MAX_QUEUED_TRACKS=2 gunicorn", server="caps"),
    Example(
        "docs/api.md",
        "curl -si -X POST $ENCORE_URL/api/v1/music -H 'Content-Type: application/json' -d "
        '\'{"mode": "instrumental", "tags": "lo-fi"}\'',
        url="caps",
        expect=(
            JSON_ID,
            r"HTTP/1\.1 429",
            r"(?i)Retry-After: \d+",
            r'"error":\s*"queue full: 2 tracks are open and the service takes at most 2; this job has 2"',
        ),
    ),
    Example(
        "docs/api.md", "ENCORE_SUBMIT_RATE_LIMIT='10/minute;200/day' API_TOKEN=secret gunicorn", server="ratelimit"
    ),
    Example(
        "docs/api.md",
        "-H 'Authorization: Bearer secret'",
        url="ratelimit",
        expect=(
            r"HTTP/1\.1 202",
            r"(?i)X-RateLimit-Limit: 10",
            r"(?i)X-RateLimit-Remaining: 9",
            r"(?i)X-RateLimit-Reset: \d+",
            JSON_ID,
        ),
    ),
    Example("docs/api.md", "python -m app.control.readiness gpu0@$(hostname)", expect=(r'"ready":\s*true',)),
    Example(
        "docs/api.md",
        "-F video=@face.mp4 -F audio=@speech.wav -F fps=25\n",
        job="lipsync",
        expect=(JSON_ID, r'"kind":\s*"lipsync"', r'"state":\s*"done"'),
        files={"synced.mp4": MP4_AT_4},
    ),
    Example(
        "docs/api.md",
        "curl -s $ENCORE_URL/tags",
        expect=(r'"genre_style"', r'"total_gpus"', r'"status":\s*"completed"'),
    ),
    # docs/operations.md
    Example(
        "docs/operations.md",
        'encore submit music --tags "lo-fi, piano" --lyrics-file song.txt',
        timeout_s=360,
        expect=(
            r"job [0-9a-f]{32} done after[\s\S]*track1\.mp3",
            r"lipsync\.mp4",
            r"gpu0@\S+",
            r"drain",
            r"job [0-9a-f]{32} canceled",
        ),
        files={"results/lipsync.mp4": MP4_AT_4},
    ),
    Example(
        "docs/operations.md",
        "OTEL_EXPORTER_OTLP_ENDPOINT=http://otel-collector:4318",
        then=f"import {SETTINGS} as c; s = c.load_settings(); print('otel:', s.otel_endpoint, s.otel_service_name)",
        expect=(r"otel: http://otel-collector:4318 encore",),
    ),
    # docs/development.md
    Example("docs/development.md", "python scripts/config_table.py --check", expect=(r"table matches",)),
]

# Commands CI cannot run, each with the reason; `ci` names a file CI runs that holds the same command.
NOT_RUN = {
    ("README.md", "bash scripts/demo.sh"): (
        (
            "demo.sh runs scripts/setup.sh (system packages, the venv, models/ in the checkout) and then the whole "
            "demo on :8000 for minutes; test.sh is what CI runs"
        ),
        (".ci/run", "bash scripts/test.sh"),
    ),
    ("docs/deployment.md", "docker compose up -d"): (
        "needs a Docker engine and GPUs; tests/test_deploy.py validates docker-compose.yml",
        None,
    ),
    ("docs/deployment.md", "docker-compose --profile s3 up"): (
        "needs a Docker engine; tests/test_deploy.py validates the compose file, tests/test_s3_store.py the backend",
        None,
    ),
    ("docs/deployment.md", "python -m app events --bind 0.0.0.0:8001"): (
        (
            "binds the fixed ports 8000 and 8001, which another run on the machine may hold; "
            "tests/test_events_server.py starts the same command on free ports (harness/stack.py) and the web "
            "with ENCORE_EVENTS_URL"
        ),
        ("harness/stack.py", '"-m", "app", "events", "--bind"'),
    ),
    ("docs/models.md", "ENCORE_MUSIC_PROFILE=khala"): (
        "needs the real Khala checkpoints (not downloadable here)",
        None,
    ),
    ("docs/models.md", "python -m app.pipeline.tiny --out models/tiny"): (
        "scripts/setup.sh runs this very command on every CI run (scripts/test.sh)",
        ("scripts/setup.sh", "-m app.pipeline.tiny --out models/tiny --lipsync-out models/lipsync-tiny"),
    ),
    ("docs/testing.md", 'bash scripts/test.sh -m "not slow"'): (
        "runs the test suite from inside itself; tests/test_tiers.py collects the fast tier, CI runs the whole one",
        (".ci/run", "bash scripts/test.sh"),
    ),
}


def runnable_blocks() -> list[Block]:
    return [block for block in blocks() if block.info in RUNNABLE]


def block_for(doc: str, key: str) -> Block:
    found = [block for block in runnable_blocks() if block.doc == doc and key in block.text]
    assert len(found) == 1, f"{doc}: {len(found)} runnable blocks hold {key!r} (want exactly one)"
    return found[0]


def test_every_block_has_an_info_string():
    bare = [block.where for block in blocks() if not block.info]
    assert not bare, f"fenced blocks without an info string (bash/sh to run, text otherwise): {bare}"


def test_every_runnable_block_is_run_or_listed_with_a_reason():
    claimed: dict[str, str] = {}
    for doc, key in [(e.doc, e.key) for e in EXAMPLES] + list(NOT_RUN):
        where = block_for(doc, key).where
        assert where not in claimed, f"{where} is claimed by {claimed[where]!r} and {key!r}"
        claimed[where] = key
    unclaimed = [block.where for block in runnable_blocks() if block.where not in claimed]
    assert not unclaimed, f"shell examples that no test runs and NOT_RUN does not list: {unclaimed}"


@pytest.mark.parametrize("entry", sorted(NOT_RUN), ids=lambda entry: f"{entry[0]}[{entry[1][:30]}]")
def test_examples_not_run_here_are_run_by_ci_where_it_says_so(entry):
    reason, ci = NOT_RUN[entry]
    assert reason
    block_for(*entry)
    if ci:
        script, command = ci
        assert command in (REPO / script).read_text(encoding="utf-8"), f"{script} no longer runs {command!r}"


# -- the harness ----------------------------------------------------------------------------------------------------
def _leading(path: Path, magic: bytes) -> bool:
    head = path.read_bytes()[:16]
    return head[4:8] == magic if magic == MP4_AT_4 else head.startswith(magic) or (magic == MP3 and head[:1] == b"\xff")


class Harness:
    """A stack (its Redis database, a gunicorn web) for the examples, a scratch folder they run in (with the
    project's entry files linked in and song.txt, face.mp4, speech.wav), the finished jobs JOB_ID names, and
    the long-running commands the examples start (kept until the module ends)."""

    def __init__(self, stack: Stack, folder: Path):
        self.stack, self.folder = stack, folder
        self.servers: dict[str, tuple[subprocess.Popen, Path, str]] = {}
        self.jobs: dict[str, str] = {}
        for name in ("worker_entrypoint.sh", "gunicorn.conf.py", "scripts"):
            (folder / name).symlink_to(REPO / name)
        self._make_inputs()
        self.web = stack.start_gunicorn()
        self.env = {
            **os.environ,
            **stack.env,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(REPO),
            "ENCORE_PYTHON": sys.executable,
            "PYTHONWARNINGS": "ignore",
        }
        for name in ("API_TOKEN", "ENCORE_API_TOKEN"):
            self.env.pop(name, None)

    def _make_inputs(self) -> None:
        import skimage.data

        from app.pipeline.media import samples

        (self.folder / "song.txt").write_text("[verse]\nhello world\n[chorus]\nencore\n", encoding="utf-8")
        samples.make_face_video(self.folder / "face.mp4", skimage.data.astronaut()[::2, ::2].copy(), 3.2, 25)
        samples.make_test_tone(self.folder / "speech.wav", 1.2, 330.0)

    # -- servers ----------------------------------------------------------------------------------------------
    def url(self, name: str) -> str:
        if name == "web":
            return self.web
        return self.server(name)[2]

    def server(self, name: str) -> tuple[subprocess.Popen, Path, str]:
        """The long-running example `name`, started (and waited for) the first time it is asked for."""
        if name not in self.servers:
            example = next(e for e in EXAMPLES if e.server == name)
            port = free_port()
            env = {**self.env, "ENCORE_WEB_BIND": f"127.0.0.1:{port}", "ENCORE_WEB_WORKERS": "1"}
            log = self.folder / f"{name}.out"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    ["bash", "-c", block_for(example.doc, example.key).text],
                    cwd=self.folder,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.servers[name] = (proc, log, f"http://127.0.0.1:{port}")
            wait_until(lambda: self._ready(name), 240, 0.5, f"the example server {name}")
        return self.servers[name]

    def _ready(self, name: str) -> bool:
        proc, log, url = self.servers[name]
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited {proc.returncode}: {log.read_text(errors='replace')[-3000:]}")
        if name == "worker":
            return self.stack.client.get("/readyz").status_code == 200
        if name == "webhooks":
            ping = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "app",
                    "inspect",
                    "ping",
                    "-d",
                    f"webhooks@{socket.gethostname()}",
                    "--timeout",
                    "2",
                ],
                check=False,
                cwd=self.folder,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            return ping.returncode == 0 and "pong" in ping.stdout
        try:
            return requests.get(f"{url}/healthz", timeout=2).ok
        except requests.RequestException:
            return False

    def stop(self) -> None:
        for proc, _, _ in self.servers.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    # -- jobs ---------------------------------------------------------------------------------------------------
    def job(self, kind: str) -> str:
        """A job JOB_ID may name: `music` and `lipsync` finished done, `canceled` canceled before it ran."""
        if kind not in self.jobs:
            self.server("worker")
            if kind == "music":
                job_id = self.stack.submit_music(num_tracks=1, duration_s=2.0)
            elif kind == "lipsync":
                with open(self.folder / "face.mp4", "rb") as video, open(self.folder / "speech.wav", "rb") as audio:
                    reply = self.stack.client.post(
                        "/api/v1/lipsync",
                        data={"video": (video, "face.mp4"), "audio": (audio, "speech.wav")},
                        content_type="multipart/form-data",
                    )
                assert reply.status_code == 202, reply.get_json()
                job_id = reply.get_json()["job_id"]
            else:
                job_id = self.stack.submit_music(num_tracks=1, duration_s=2.0)
                assert self.stack.client.delete(f"/api/v1/jobs/{job_id}").status_code == 200
            want = "canceled" if kind == "canceled" else "done"
            record = self.stack.wait_job(job_id, timeout=240)
            assert record["state"] == want, record
            self.jobs[kind] = job_id
        return self.jobs[kind]

    def end_open_jobs(self) -> None:
        """Cancel what an example left running, so the next one finds the worker free."""

        def open_jobs() -> list[str]:
            jobs = self.stack.client.get("/api/v1/jobs?limit=500").get_json()["jobs"]
            return [job["job_id"] for job in jobs if job["state"] not in ENDED]

        for job_id in open_jobs():
            self.stack.client.delete(f"/api/v1/jobs/{job_id}")
        wait_until(lambda: not open_jobs(), 150, 0.2, "the examples' jobs to end")

    # -- running one example --------------------------------------------------------------------------------------
    def run(self, example: Example) -> tuple[str, Path]:
        block = block_for(example.doc, example.key)
        if example.server:
            proc, log, _ = self.server(example.server)
            assert proc.poll() is None
            return log.read_text(errors="replace"), self.folder
        folder = self.folder / f"run-{block.line}-{Path(block.doc).stem}"
        folder.mkdir()
        for name in ("worker_entrypoint.sh", "gunicorn.conf.py", "scripts", "song.txt", "face.mp4", "speech.wav"):
            (folder / name).symlink_to(self.folder / name)
        script = "set -eo pipefail\n" + block.text
        if example.then:
            script += f"python -c {_shell_quote(example.then)}\n"
        env = {**self.env, "ENCORE_URL": self.url(example.url), "JOB_ID": self.job(example.job)}
        done = subprocess.run(
            ["bash", "-c", script],
            check=False,
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=example.timeout_s,
        )
        output = done.stdout + done.stderr
        (folder / "output.txt").write_text(output, encoding="utf-8")  # to read when an expectation fails
        self.end_open_jobs()
        assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{output[-4000:]}"
        return output, folder


def _shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


@pytest.fixture(scope="module")
def harness(redis_base_url, tiny_models, tmp_path_factory):
    """One stack for every example: workers are the slow part to start. The web signs webhooks and preloads."""
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    stack = Stack(
        redis_base_url,
        tiny_models,
        tmp_path_factory.mktemp("docs-stack"),
        ENCORE_PRELOAD="1",
        ENCORE_WEBHOOK_SECRET=secret,
        ENCORE_WEB_WORKERS="1",
        ENCORE_WEB_THREADS="16",
    )
    harness = Harness(stack, tmp_path_factory.mktemp("docs-examples"))
    try:
        harness.server("worker")
        yield harness
    finally:
        harness.stop()
        stack.close()


@pytest.mark.slow  # every example against a stack with workers (~30 s here)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda example: example.name)
def test_the_example_runs_and_prints_what_the_docs_say(harness, example: Example):
    output, folder = harness.run(example)
    missing = [pattern for pattern in example.expect if not re.search(pattern, output)]
    assert not missing, f"{example.name}: output lacks {missing}:\n{output[-4000:]}"
    for name, magic in example.files.items():
        path = folder / name
        assert path.is_file() and _leading(path, magic), f"{example.name}: {name} is not what it should be"
