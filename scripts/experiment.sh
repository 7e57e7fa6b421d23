#!/usr/bin/env bash
# Install what the LM experiments need into .venv (the demo's environment plus peft, sacrebleu, matplotlib and
# datasets), then run one: `bash scripts/experiment.sh lm_domains|lm_ppl|lm_sentiment|lm_translation|lm_stream|lm_suite
# [its arguments]`.
set -euo pipefail
EXPERIMENTS="lm_domains lm_ppl lm_sentiment lm_translation lm_stream lm_suite"
usage() {
  echo "usage: bash scripts/experiment.sh EXPERIMENT [its arguments]   (EXPERIMENT: ${EXPERIMENTS// /, })" >&2
  echo "       bash scripts/experiment.sh EXPERIMENT --help              its options" >&2
}
if [ $# -eq 0 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  usage
  [ $# -eq 0 ] && exit 2 || exit 0
fi
name=$1
shift
case " $EXPERIMENTS " in
  *" $name "*) ;;
  *) echo "scripts/experiment.sh: unknown experiment '$name'" >&2; usage; exit 2 ;;
esac
. "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
faast_env "demo,experiments"
cd "$ROOT"
python -m "faast_lab.experiments.$name" "$@"
