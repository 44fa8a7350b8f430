"""The web's cancel sweeper (app/http/sweeper.py) as gunicorn starts it: its behaviour with a dead stage is tested
with real processes in tests/test_reliability.py; here, that the shared gunicorn config serves any app."""

from __future__ import annotations

import runpy
from types import SimpleNamespace

from flask import Flask

from harness.processes import REPO


def test_gunicorn_config_serves_an_app_that_is_not_encores():
    """The benches serve their baselines (a hello-world Flask app) with the same gunicorn config: its
    post_worker_init must not fail there (it did, KeyError 'encore': the worker never booted)."""
    config = runpy.run_path(str(REPO / "gunicorn.conf.py"))
    assert config["post_worker_init"](SimpleNamespace(wsgi=Flask("baseline"))) is None
