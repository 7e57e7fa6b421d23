#!/usr/bin/env bash
# Install what the LM experiments need into .venv (the demo's environment plus peft, sacrebleu, matplotlib and
# datasets), then run one: `bash scripts/experiment.sh lm_ppl|lm_sentiment|lm_translation [its arguments]`.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
name=${1:?usage: bash scripts/experiment.sh lm_ppl|lm_sentiment|lm_translation [arguments]}
shift
case "$name" in
  lm_ppl|lm_sentiment|lm_translation) ;;
  *) echo "scripts/experiment.sh: unknown experiment '$name' (expected lm_ppl, lm_sentiment or lm_translation)" >&2; exit 2 ;;
esac
faast_env "demo,experiments"
cd "$ROOT"
python "experiments/$name.py" "$@"
