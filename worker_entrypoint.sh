#!/usr/bin/env bash
# Start the Encore workers for one GPU:  worker_entrypoint.sh <gpu-index> [extra celery worker options]
# (or GPU_ID=<n> worker_entrypoint.sh). Two Celery workers, both logging to logs/worker_<n>.log and stdout:
#   gpu<n>@<host>  pins CUDA_VISIBLE_DEVICES=<n>, consumes only queue gpu<n>, runs one prefork child (the master
#                  stays responsive, hard time limits and terminate work, CUDA is only touched in the child) and
#                  the GPU stages; without CUDA the same command runs it on the CPU;
#   cpu<n>@<host>  the host's CPU-stage worker: consumes gpu<n>.cpu (music export, lip-sync prepare and mux:
#                  the stages that need no GPU, sent there while it is live; app/core/queues.py), sees no GPU,
#                  ENCORE_CPU_CONCURRENCY children (default 1); it shares the host's scratch (the same
#                  ENCORE_WORKER_CACHE_DIR). The extra options go to the GPU worker only.
# ENCORE_WORKER_ROLE=gpu starts only the GPU worker (its CPU stages then run in place), =cpu only the CPU-stage
# worker; default: both, the CPU-stage worker in the background of the GPU worker's process group (stop the group).
# Both send task events (Flower shows both).
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
role="${ENCORE_WORKER_ROLE:-both}"
case "$role" in gpu|cpu|both) ;; *) echo "ENCORE_WORKER_ROLE must be gpu, cpu or both, not '$role'" >&2; exit 2 ;; esac
cpu_children="${ENCORE_CPU_CONCURRENCY:-1}"
if ! [[ "$cpu_children" =~ ^[1-9][0-9]*$ ]]; then
  echo "ENCORE_CPU_CONCURRENCY must be a whole number >= 1, not '$cpu_children'" >&2
  exit 2
fi
cd "$(dirname "$0")"
log_dir="${ENCORE_LOG_DIR:-logs}"
mkdir -p "$log_dir"
python_bin="${ENCORE_PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
# Output goes to stdout and the log file; exec keeps the PID so signals reach celery directly.
exec > >(tee -a "$log_dir/worker_${gpu}.log") 2>&1
cpu_worker=("$python_bin" -m celery -A app worker -Q "gpu${gpu}.cpu" -n "cpu${gpu}@%h"
            -P prefork -c "$cpu_children" -E --loglevel "${ENCORE_LOG_LEVEL:-INFO}")
if [ "$role" = cpu ]; then
  CUDA_VISIBLE_DEVICES="" exec "${cpu_worker[@]}"
fi
if [ "$role" = both ]; then
  CUDA_VISIBLE_DEVICES="" "${cpu_worker[@]}" &
fi
# Inside a container that was given only its own GPU that card is device 0: ENCORE_PIN_DEVICE=0 says so.
export CUDA_VISIBLE_DEVICES="${ENCORE_PIN_DEVICE:-$gpu}"
exec "$python_bin" -m celery -A app worker \
  -Q "gpu${gpu}" -n "gpu${gpu}@%h" \
  -P prefork -c 1 -E \
  --loglevel "${ENCORE_LOG_LEVEL:-INFO}" "$@"
