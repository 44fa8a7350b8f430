#!/usr/bin/env bash
# On the GPU machine: unpack var/device-carry (bench/device_carry.sh), then run one bench and keep its
# output under $OUT:   bash bench/device_run.sh bench/gpu_lipsync.py [bench options]
set -euo pipefail
cd "$(dirname "$0")/.."
carry=var/device-carry
stage=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$stage/site" "$carry"/wheels/*.whl
mkdir -p "$stage/bin"
tar -C "$stage/bin" -xJf "$carry/bin/ffmpeg.tar.xz"
xz -dc "$carry/bin/redis-server.xz" > "$stage/bin/redis-server"
chmod +x "$stage/bin/"*
export PATH="$stage/bin:$PATH" PYTHONPATH="$stage/site:${PYTHONPATH:-}" ENCORE_PYTHON=python3
export ENCORE_FFMPEG="$stage/bin/ffmpeg" ENCORE_FFPROBE="$stage/bin/ffprobe"
bench="$1"; shift
name=$(basename "$bench" .py)
out="${OUT:-var/device-out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv > "$out/nvidia-smi.csv" || true
python3 "$bench" "$@" 2> "$out/${name}.stderr" | tee "$out/h200_${name}.jsonl"
