#!/usr/bin/env bash
# README command 1: set up what is missing, start Redis/workers/web as needed, run a music job through the
# HTTP API with live progress, write the results to out/, and stop everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m app.clients.demo "$@"
