#!/usr/bin/env bash
# README command 2, and all CI runs: set up what is missing (scripts/setup.sh --test: system packages, the
# venv, tiny models, the browser), then run the whole test suite. Extra arguments go to pytest, e.g.
#   bash scripts/test.sh -m "not slow"      the fast tier (docs/testing.md)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q "$@"
