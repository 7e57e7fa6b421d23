#!/usr/bin/env bash
# Every GPU claim of faast in one command (lab/benchmarks/gpu_check.py): build faast._C, the GPU tests, the Gram fidelity
# per precision mode, the kernel / eigh / learn-stack / HF-overhead benchmarks, then the goals table. Written for the
# lent GPU machine: its system python3 holds torch (CUDA), triton, cupy, ninja and nvcc; there is no network, no venv
# and neither faast nor the lab is installed: python/ and the repository root go on PYTHONPATH here, and so does a
# temporary folder holding only the link faast_lab -> lab/ (the lab's package, lab/pyproject.toml).
#
#   bash scripts/gpu_check.sh OUTDIR [--steps build,tests,...] [--budget-s 320]   # the GPU machine, < 6 min on an H100
#   bash scripts/gpu_check.sh OUTDIR --smoke                                      # anywhere: tiny sizes, CPU
#
# Python packages the GPU image lacks travel as wheels in .whl/ (bash scripts/gpu_wheels.sh prepares them here) and
# are installed into a temporary folder first. PYTHON overrides the interpreter (default: python3).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  SITE=${TMPDIR:-/tmp}/faast-gpu-site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$ROOT"/.whl/*.whl \
    || { echo "gpu_check: installing the wheels in .whl/ failed" >&2; exit 2; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
LAB_LINK=$(mktemp -d "${TMPDIR:-/tmp}/faast-lab.XXXXXX") && ln -s "$ROOT/lab" "$LAB_LINK/faast_lab" \
  || { echo "gpu_check: cannot link the lab into a temporary folder" >&2; exit 2; }
export PYTHONPATH="$ROOT/python:$ROOT:$LAB_LINK${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" && exec "$PY" -m faast_lab.benchmarks.gpu_check "$@"
