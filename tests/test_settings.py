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

from app.core.config import Settings, declarations, load_settings

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


BOUNDED = {name: declared for name, declared in declarations().items() if declared.bounds is not None}
ENVIRONMENT_NAME = re.compile(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)+")


def test_every_setting_is_declared_once_with_its_variables_defaults_and_description():
    """One declaration per field, none of them sharing a variable with another: the table, the parser and the
    bounds all come from it."""
    undeclared = [f.name for f in dataclasses.fields(Settings) if "declaration" not in f.metadata]
    assert undeclared == [], "a Settings field not declared by setting() or its kin"
    variables = [variable for declared in declarations().values() for variable, _ in declared.variables]
    assert len(variables) == len(set(variables)), "a variable read by two settings"
    for name, declared in declarations().items():
        assert declared.variables, name
        for variable, default in declared.variables:
            assert ENVIRONMENT_NAME.fullmatch(variable), (name, variable)
            assert default is None or isinstance(default, str), (name, default)  # None: read without a default
        assert declared.description.strip(), f"{name} has no description"


def test_every_numeric_setting_and_only_those_have_bounds():
    assert sorted(_numeric_fields()) == sorted(BOUNDED), "a numeric setting without bounds, or bounds of no number"


@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_a_numeric_setting_below_its_bound_refuses_to_start_naming_the_variable(monkeypatch, name):
    bounds, variable = BOUNDED[name].bounds, BOUNDED[name].variable
    monkeypatch.setenv("ENCORE_S3_PRESIGN", "1")  # ENCORE_S3_PRESIGN_S is read only then
    monkeypatch.setenv(variable, str(int(bounds.least) - 1) if bounds.least_allowed else str(int(bounds.least)))
    with pytest.raises(ValueError, match=f"^{variable} must be "):
        load_settings()
    if bounds.most is not None:
        monkeypatch.setenv(variable, str(int(bounds.most) + 1))
        with pytest.raises(ValueError, match=f"^{variable} must be <= "):
            load_settings()


@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_a_numeric_setting_that_is_not_a_number_refuses_to_start_naming_the_variable(monkeypatch, name):
    variable = BOUNDED[name].variable
    monkeypatch.setenv("ENCORE_S3_PRESIGN", "1")  # ENCORE_S3_PRESIGN_S is read only then
    monkeypatch.setenv(variable, "soon")
    with pytest.raises(ValueError, match=f"^{variable} must be (an integer|a number), not 'soon'"):
        load_settings()


@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_a_bound_holds_for_a_keyword_override_too(name):
    bounds = BOUNDED[name].bounds
    with pytest.raises(ValueError, match=f"^{BOUNDED[name].variable} must be "):
        Settings(**{name: bounds.least - 1})


@pytest.mark.parametrize("value", ["backbone=soon", "backbone", "decode=60/"])
def test_a_time_limit_that_is_not_a_number_refuses_to_start_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("ENCORE_TIME_LIMITS", value)
    with pytest.raises(ValueError, match="^ENCORE_TIME_LIMITS: "):
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
