#!/usr/bin/env bash
# Run one module of the lab (lab/: the package faast_lab, lab/pyproject.toml) from this checkout, installed or not:
#
#   bash scripts/lab.sh benchmarks.profile_read --device cuda --out-dir OUT    # python3 -m faast_lab.benchmarks....
#   bash scripts/lab.sh experiments.readout_recipe --out OUT
#
# Where faast_lab does not import (the lent GPU machine: no venv, no pip index, nothing installed), python/, the
# repository root and a temporary folder holding only the link faast_lab -> lab/ go on PYTHONPATH, as
# scripts/gpu_check.sh does. Elsewhere install the lab (scripts/_env.sh does, with the test or experiments extra) and
# run `python -m faast_lab.<module>`. PYTHON overrides the interpreter (default: python3).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
if [ $# -eq 0 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash scripts/lab.sh MODULE [its arguments]   (MODULE: e.g. benchmarks.profile_read, experiments.lm_domains)" >&2
  exit 2
fi
module=$1
shift
if ! "$PY" -c "import faast_lab" >/dev/null 2>&1; then
  LAB_LINK=$(mktemp -d "${TMPDIR:-/tmp}/faast-lab.XXXXXX")
  ln -s "$ROOT/lab" "$LAB_LINK/faast_lab"
  export PYTHONPATH="$ROOT/python:$ROOT:$LAB_LINK${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" -m "faast_lab.$module" "$@"
