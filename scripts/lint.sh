#!/usr/bin/env bash
# Install what the checks need into .venv (the "test" extra pins ruff, mypy and the stubs), then lint: ruff's rules,
# ruff's formatting (checked, never rewritten) and mypy on the files pyproject.toml's [tool.mypy] names. Exits non-zero
# at the first check that fails. To fix formatting: .venv/bin/ruff format <paths>.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
faast_env test
cd "$ROOT"
PATHS=(python faast_kernels tests lab examples scripts setup.py conftest.py)
echo "lint: ruff check" >&2
ruff check "${PATHS[@]}"
echo "lint: ruff format --check" >&2
ruff format --check "${PATHS[@]}"
echo "lint: mypy" >&2
mypy
