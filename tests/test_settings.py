"""Settings that would silently weaken the service are refused when they are read, naming the variable, and the
web app then refuses to start (no fallback to "no authentication")."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.core.config import NUMERIC_BOUNDS, load_settings

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value", [",", " ", "a,,b", "a, ,b", "a,", "to ken"])
def test_an_api_token_setting_with_an_empty_or_broken_entry_is_refused(monkeypatch, value):
    monkeypatch.setenv("API_TOKEN", value)
    with pytest.raises(ValueError, match="API_TOKEN"):
        load_settings()


@pytest.mark.parametrize("value", ["tök", "tok\x85", "a,b\u00a0c", "tok\x7f"])
def test_an_api_token_that_is_not_printable_ascii_is_refused(monkeypatch, value):
    monkeypatch.setenv("API_TOKEN", value)
    with pytest.raises(ValueError, match="API_TOKEN: entry [12] holds (white space|a character that is not printable)"):
        load_settings()


@pytest.mark.parametrize(
    "value, message",
    [
        ("OFF", "write `off` \\(lower case\\)"),
        ("Off", "write `off`"),
        ("0/minute", "lets no request through"),
        ("10/minute;0/day", "lets no request through"),
        ("lots", "couldn't parse"),
    ],
)
def test_a_submit_rate_that_would_refuse_every_submit_or_is_not_off_is_refused(monkeypatch, value, message):
    monkeypatch.setenv("ENCORE_SUBMIT_RATE_LIMIT", value)
    with pytest.raises(ValueError, match=f"ENCORE_SUBMIT_RATE_LIMIT.*{message}"):
        load_settings()


@pytest.mark.parametrize("value, tokens", [("", ()), ("a", ("a",)), ("a, b", ("a", "b")), (" a ", ("a",))])
def test_api_tokens_are_read_as_written(monkeypatch, value, tokens):
    monkeypatch.setenv("API_TOKEN", value)
    assert load_settings().api_tokens == tokens


def test_the_web_app_refuses_to_start_on_a_token_setting_that_holds_no_token():
    started = subprocess.run(
        [sys.executable, "-c", "from app.web import create_app; create_app()"],
        cwd=REPO,
        env={**os.environ, "API_TOKEN": ","},
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0
    assert "API_TOKEN: entry 1 of 2 is empty" in started.stderr


def _numeric_fields() -> list[str]:
    settings = load_settings()
    return [
        f.name
        for f in dataclasses.fields(settings)
        if isinstance(getattr(settings, f.name), (int, float)) and not isinstance(getattr(settings, f.name), bool)
    ]


def test_every_numeric_setting_has_bounds_and_is_read_from_the_variable_its_message_names():
    source = (REPO / "app" / "core" / "config.py").read_text()
    fields = _numeric_fields()
    assert sorted(fields) == sorted(NUMERIC_BOUNDS), "a numeric setting without bounds, or bounds of no setting"
    for name in fields:
        assert re.search(
            rf'^\s+{name}: [^=\n]*= field\(\s*default_factory=lambda: _(int|float)\(\s*"ENCORE_{name.upper()}"',
            source,
            re.M,
        ), f"{name} is not read as ENCORE_{name.upper()} by _int/_float"


@pytest.mark.parametrize("name", sorted(NUMERIC_BOUNDS))
def test_a_numeric_setting_below_its_bound_refuses_to_start_naming_the_variable(monkeypatch, name):
    least, least_allowed, most = NUMERIC_BOUNDS[name]
    variable = f"ENCORE_{name.upper()}"
    monkeypatch.setenv("ENCORE_S3_PRESIGN", "1")  # ENCORE_S3_PRESIGN_S is read only then
    monkeypatch.setenv(variable, str(int(least) - 1) if least_allowed else str(int(least)))
    with pytest.raises(ValueError, match=variable):
        load_settings()
    if most is not None:
        monkeypatch.setenv(variable, str(int(most) + 1))
        with pytest.raises(ValueError, match=variable):
            load_settings()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "soon", ""])
def test_a_number_that_is_not_finite_or_not_a_number_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("ENCORE_LEASE_S", value)
    with pytest.raises(ValueError, match="ENCORE_LEASE_S"):
        load_settings()


def test_the_shortest_audio_may_not_exceed_the_longest(monkeypatch):
    monkeypatch.setenv("ENCORE_MIN_AUDIO_S", "30")
    monkeypatch.setenv("ENCORE_MAX_AUDIO_S", "10")
    with pytest.raises(ValueError, match="ENCORE_MIN_AUDIO_S"):
        load_settings()


def test_a_worker_refuses_to_start_on_a_setting_that_makes_no_sense():
    celery = Path(sys.executable).with_name("celery")
    started = subprocess.run(
        [str(celery), "-A", "app", "worker", "-Q", "gpu0", "-c", "1"],
        cwd=REPO,
        env={**os.environ, "ENCORE_LEASE_S": "nan", "REDIS_URL": "redis://127.0.0.1:1/0"},
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0
    assert "ENCORE_LEASE_S must be a finite number, not 'nan'" in started.stderr
