#!/usr/bin/env bash
# Idempotent: headless Chromium + chromedriver (Debian packages) for the web page test (tests/test_web_page.py).
# The Python side (selenium) comes from requirements.txt; it is checked here, never installed here.
# Selenium is handed both binaries' paths, so Selenium Manager never tries to download a browser or driver.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
# Fonts, so the screenshot shows text rather than boxes (chromium only recommends them).
[ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)

if [ ${#missing[@]} -gt 0 ]; then
  echo "[browser] installing ${missing[*]} (Debian packages)"
  if command -v apt-get >/dev/null; then
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || { echo "[browser] could not install ${missing[*]}" >&2; exit 1; }
  else
    echo "[browser] please install: ${missing[*]}" >&2; exit 1
  fi
fi

echo "[browser] ready: $(chromium --version 2>/dev/null | head -1), $(chromedriver --version 2>/dev/null | cut -d' ' -f1-2)"
if [ -x .venv/bin/python ] && ! .venv/bin/python -c "import selenium" 2>/dev/null; then
  echo "[browser] note: selenium is not in .venv yet (scripts/setup.sh installs it from requirements.txt)"
fi
