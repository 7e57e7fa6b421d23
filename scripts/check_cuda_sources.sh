#!/usr/bin/env bash
# Compile-check csrc/ without a GPU: nvcc compiles the CUDA source and the C++ schema file against torch's headers, so
# a syntax or API error fails CI. Nothing is linked or run. Skipped (exit 0, with a message) when nvcc is absent.
#
# Header sets:
#   1. always: the torch of [python] (a CPU build is enough) with the newest cuSOLVER / cuBLAS / cuSPARSE headers.
#      A CPU build of torch lacks two things the CUDA headers need, both supplied here: the include/ folders of the
#      nvidia-cusolver, nvidia-cublas and nvidia-cusparse wheels (ATen's CUDAContext.h includes them), downloaded once
#      into $FAAST_CUDA_HEADERS; and c10/cuda/impl/cuda_cmake_macros.h, generated when torch is built with CUDA (one
#      line is enough to compile).
#   2. with FAAST_CHECK_CUDA12=1: a CUDA 12 torch, torch 2.7.1+cu126 (the manylinux wheel on PyPI is a CUDA 12.6
#      build), with the CUDA 12.6 cuSOLVER 11.7.1 / cuBLAS / cuSPARSE headers it was built with. Downloaded once (the
#      torch wheel is ~820 MB) into $FAAST_CUDA12_HEADERS (default .cache/cuda12-headers); only the include/ folders
#      are kept and nothing is installed. Once there (or in a folder prepared by hand with torch/include and
#      cuda/include in it), set 2 is checked on every run, offline.
#      nvcc here keeps its own CUDA runtime headers: nvcc 13 refuses the CUDA 12 runtime headers ("CUDA compiler and
#      CUDA toolkit headers are incompatible"), and no CUDA 12 nvcc is on PyPI (nvidia-cuda-nvcc-cu12 ships ptxas
#      only). So set 2 checks csrc/ against the CUDA 12 torch's C++ API and the CUDA 12.6 cuSOLVER API, not a
#      CUDA 12 compiler.
# Usage: bash scripts/check_cuda_sources.sh [python]   (default: the python on PATH, which must have torch)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${1:-python}
if ! command -v nvcc >/dev/null 2>&1; then
  echo "check_cuda_sources: nvcc not found; skipping the compile check of csrc/" >&2
  exit 0
fi

# extract_includes DEST WHEEL...: every file under an include/ folder of the wheels, into DEST (the path after the
# first "include/" kept).
extract_includes() {
  "$PY" - "$@" <<'PY'
import pathlib, sys, zipfile
dest = pathlib.Path(sys.argv[1])
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            parts = name.split("/")
            if "include" in parts and not name.endswith("/"):
                target = dest / "/".join(parts[parts.index("include") + 1 :])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
PY
}

download() {  # download DEST REQUIREMENT...
  local dest=$1
  shift
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$dest" "$@"
}

HEADERS=${FAAST_CUDA_HEADERS:-$ROOT/.cache/cuda-headers}
if [ ! -f "$HEADERS/.complete" ]; then
  rm -rf "$HEADERS" && mkdir -p "$HEADERS/wheels" "$HEADERS/include/c10/cuda/impl"
  download "$HEADERS/wheels" nvidia-cusolver nvidia-cublas nvidia-cusparse
  extract_includes "$HEADERS/include" "$HEADERS"/wheels/*.whl
  rm -rf "$HEADERS/wheels"
  echo "#define C10_CUDA_BUILD_SHARED_LIBS" > "$HEADERS/include/c10/cuda/impl/cuda_cmake_macros.h"
  touch "$HEADERS/.complete"
fi

CUDA12=${FAAST_CUDA12_HEADERS:-$ROOT/.cache/cuda12-headers}
if [ "${FAAST_CHECK_CUDA12:-0}" != "0" ] && [ ! -d "$CUDA12/torch/include" ]; then
  echo "check_cuda_sources: fetching the headers of torch 2.7.1+cu126 and CUDA 12.6 (about 1.6 GB of wheels, once)"
  rm -rf "$CUDA12/wheels" && mkdir -p "$CUDA12/wheels"
  download "$CUDA12/wheels" torch==2.7.1
  "$PY" - "$CUDA12"/wheels/torch-*.whl > "$CUDA12/wheels/version.txt" <<'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    text = z.read("torch/version.py").decode()
print(re.search(r"__version__ = '([^']+)'", text).group(1), "CUDA", re.search(r"cuda: .*= '([^']+)'", text).group(1))
PY
  extract_includes "$CUDA12/wheels/torch-include" "$CUDA12"/wheels/torch-*.whl
  rm -f "$CUDA12"/wheels/torch-*.whl
  # The versions torch 2.7.1+cu126 itself requires.
  download "$CUDA12/wheels" nvidia-cusolver-cu12==11.7.1.2 nvidia-cublas-cu12==12.6.4.1 nvidia-cusparse-cu12==12.5.4.2
  mkdir -p "$CUDA12/cuda/include" "$CUDA12/torch"
  extract_includes "$CUDA12/cuda/include" "$CUDA12"/wheels/*.whl
  mv "$CUDA12/wheels/version.txt" "$CUDA12/torch/version.txt"
  mv "$CUDA12/wheels/torch-include" "$CUDA12/torch/include"  # last: its presence marks a complete download
  rm -rf "$CUDA12/wheels"
fi

read -r TORCH_INC TORCH_API_INC PY_INC < <("$PY" - <<'PY'
import sysconfig
from torch.utils.cpp_extension import include_paths
paths = include_paths()
print(paths[0], paths[1], sysconfig.get_paths()["include"])
PY
)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# compile_set NAME TORCH_INCLUDE TORCH_API_INCLUDE CUDA_LIBRARY_INCLUDE: both sources against one header set.
compile_set() {
  local name=$1 start
  local flags=(-std=c++20 -DTORCH_EXTENSION_NAME=_C -D_GLIBCXX_USE_CXX11_ABI=1 -I"$4" -I"$2" -I"$3" -I"$PY_INC")
  start=$(date +%s)
  nvcc "${flags[@]}" -c "$ROOT/csrc/cuda/batched_eigh.cu" -o "$OUT/batched_eigh.o"
  nvcc "${flags[@]}" -x c++ -c "$ROOT/csrc/faast_ops.cpp" -o "$OUT/faast_ops.o"
  echo "check_cuda_sources: csrc/ compiles against $name with $(nvcc --version | tail -1) in $(( $(date +%s) - start )) s"
}

torch_version=$("$PY" -c "import torch; print(torch.__version__)")
compile_set "torch $torch_version and the newest cuSOLVER headers" "$TORCH_INC" "$TORCH_API_INC" "$HEADERS/include"
if [ -d "$CUDA12/torch/include" ]; then
  compile_set "torch $(cat "$CUDA12/torch/version.txt" 2>/dev/null || echo "in $CUDA12") and cuSOLVER 11.7 headers" \
    "$CUDA12/torch/include" "$CUDA12/torch/include/torch/csrc/api/include" "$CUDA12/cuda/include"
fi
