#!/usr/bin/env bash
# The GPU run on the lent machine: bash bench/gpu_run.sh OUT [bench.gpu_run flags] (bench/gpu_run.py says
# what runs). Installs the wheels that bench/gpu_prepare.sh fetched into .whl/ with pip's --target
# (never torch: the machine's own torch, Triton and CUDA are the ones measured), then runs the driver
# from this checkout. Exit 3 with one line when the wheels, CUDA or Triton's launcher do not work.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash bench/gpu_run.sh OUT [--dry-run] [bench.gpu_run flags]}
shift
mkdir -p "$out"
site=${FASTTRAIN_GPU_SITE:-/tmp/fasttrain-gpu-site}
wheels=${FASTTRAIN_GPU_WHEELS:-.whl}
# The dry run (CPU, CI) uses this machine's own packages: the wheels are CPython 3.12's.
if [[ " $* " != *" --dry-run "* ]] && compgen -G "$wheels/*.whl" >/dev/null; then
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$wheels"/*.whl >"$out/wheels.log" 2>&1; then
    echo "gpu_run: installing $wheels/*.whl failed: $(tail -1 "$out/wheels.log")" >&2
    exit 3
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec python3 -m bench.gpu_run --out "$out" "$@"
