"""Settings that would silently weaken the service are refused when they are read, naming the variable, and the
web app then refuses to start (no fallback to "no authentication")."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.core.config import load_settings

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value", [",", " ", "a,,b", "a, ,b", "a,", "to ken"])
def test_an_api_token_setting_with_an_empty_or_broken_entry_is_refused(monkeypatch, value):
    monkeypatch.setenv("API_TOKEN", value)
    with pytest.raises(ValueError, match="API_TOKEN"):
        load_settings()


@pytest.mark.parametrize("value, tokens", [("", ()), ("a", ("a",)), ("a, b", ("a", "b")), (" a ", ("a",))])
def test_api_tokens_are_read_as_written(monkeypatch, value, tokens):
    monkeypatch.setenv("API_TOKEN", value)
    assert load_settings().api_tokens == tokens


def test_the_web_app_refuses_to_start_on_a_token_setting_that_holds_no_token():
    started = subprocess.run([sys.executable, "-c", "from app.web import create_app; create_app()"], cwd=REPO,
                             env={**os.environ, "API_TOKEN": ","}, check=False, capture_output=True, text=True,
                             timeout=120)
    assert started.returncode != 0
    assert "API_TOKEN: entry 1 of 2 is empty" in started.stderr
