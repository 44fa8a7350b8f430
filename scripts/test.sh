#!/usr/bin/env bash
# README command 2 (and what CI runs): set up what is missing, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install_browser.sh  # headless Chromium for tests/test_web_page.py
exec .venv/bin/python -m pytest -q "$@"
