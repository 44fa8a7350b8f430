#!/usr/bin/env bash
# README command 2 (and what CI runs): set up what is missing, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
