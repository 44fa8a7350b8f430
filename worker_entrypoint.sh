#!/usr/bin/env bash
# Start the Encore worker for one GPU:  worker_entrypoint.sh <gpu-index> [extra celery worker options]
# (or GPU_ID=<n> worker_entrypoint.sh). Pins CUDA_VISIBLE_DEVICES=<n>, names the worker gpu<n>@<host>,
# consumes only queue gpu<n>, runs one prefork child (the master stays responsive, hard time limits and
# terminate work, CUDA is only touched in the child), sends task events, and logs to
# logs/worker_<n>.log as well as stdout. Without CUDA the same command runs the worker on the CPU.
set -euo pipefail
if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; then
  gpu="$1"; shift
else
  gpu="${GPU_ID:-0}"
fi
if ! [[ "$gpu" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 <gpu-index> [celery worker options]   (GPU_ID='$gpu' is not an index)" >&2
  exit 2
fi
cd "$(dirname "$0")"
# Inside a container that was given only its own GPU that card is device 0: ENCORE_PIN_DEVICE=0 says so.
export CUDA_VISIBLE_DEVICES="${ENCORE_PIN_DEVICE:-$gpu}"
log_dir="${ENCORE_LOG_DIR:-logs}"
mkdir -p "$log_dir"
python_bin="${ENCORE_PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
# Output goes to stdout and the log file; exec keeps the PID so signals reach celery directly.
exec > >(tee -a "$log_dir/worker_${gpu}.log") 2>&1
exec "$python_bin" -m celery -A app worker \
  -Q "gpu${gpu}" -n "gpu${gpu}@%h" \
  -P prefork -c 1 -E \
  --loglevel "${ENCORE_LOG_LEVEL:-INFO}" "$@"
