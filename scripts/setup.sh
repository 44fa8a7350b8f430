#!/usr/bin/env bash
# Idempotent set-up shared by the demo and the tests: system tools, the virtual environment, tiny models.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

install_system_packages() {
  local missing=()
  command -v ffmpeg >/dev/null && command -v ffprobe >/dev/null || missing+=(ffmpeg)
  # espeak-ng only voices the demo's lip-sync clip (a tone replaces it when missing): best effort.
  if ! command -v espeak-ng >/dev/null && command -v apt-get >/dev/null; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng >/dev/null 2>&1 || true
  fi
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "[setup] installing ${missing[*]} (Debian packages)"
  if command -v apt-get >/dev/null; then
    as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
      || { echo "[setup] could not install ${missing[*]}: install it and rerun" >&2; exit 1; }
  else
    echo "[setup] please install: ${missing[*]}" >&2; exit 1
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

install_system_packages
python_venv
PYTHONWARNINGS=ignore .venv/bin/python -m app.pipeline.tiny --out models/tiny --lipsync-out models/lipsync-tiny >/dev/null
echo "[setup] ready: .venv, ffmpeg $(ffmpeg -version | head -1 | cut -d' ' -f3), tiny models in models/tiny and models/lipsync-tiny"
