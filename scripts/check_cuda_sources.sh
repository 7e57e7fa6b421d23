#!/usr/bin/env bash
# Compile-check csrc/ without a GPU: nvcc compiles the CUDA source and the C++ schema file against torch's headers, so
# a syntax or API error fails CI. Nothing is linked or run. Skipped (exit 0, with a message) when nvcc is absent.
#
# A CPU build of torch lacks two things the CUDA headers need, both supplied here:
#   * the cuSOLVER / cuBLAS / cuSPARSE headers (ATen's CUDAContext.h includes them): the include/ folders of the
#     nvidia-cusolver, nvidia-cublas and nvidia-cusparse wheels, downloaded once into $FAAST_CUDA_HEADERS;
#   * c10/cuda/impl/cuda_cmake_macros.h, generated when torch is built with CUDA: one line is enough to compile.
# Usage: bash scripts/check_cuda_sources.sh [python]   (default: the python on PATH, which must have torch)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${1:-python}
if ! command -v nvcc >/dev/null 2>&1; then
  echo "check_cuda_sources: nvcc not found; skipping the compile check of csrc/" >&2
  exit 0
fi
HEADERS=${FAAST_CUDA_HEADERS:-$ROOT/.cache/cuda-headers}
if [ ! -f "$HEADERS/.complete" ]; then
  rm -rf "$HEADERS" && mkdir -p "$HEADERS/wheels" "$HEADERS/include/c10/cuda/impl"
  "$PY" -m pip download --quiet --no-deps --dest "$HEADERS/wheels" nvidia-cusolver nvidia-cublas nvidia-cusparse
  "$PY" - "$HEADERS" <<'PY'
import pathlib, sys, zipfile
root = pathlib.Path(sys.argv[1])
for wheel in (root / "wheels").glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            parts = name.split("/")
            if "include" in parts and not name.endswith("/"):
                target = root / "include" / "/".join(parts[parts.index("include") + 1 :])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
PY
  rm -rf "$HEADERS/wheels"
  echo "#define C10_CUDA_BUILD_SHARED_LIBS" > "$HEADERS/include/c10/cuda/impl/cuda_cmake_macros.h"
  touch "$HEADERS/.complete"
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
FLAGS=(-std=c++20 -DTORCH_EXTENSION_NAME=_C -D_GLIBCXX_USE_CXX11_ABI=1 -I"$HEADERS/include" -I"$TORCH_INC"
       -I"$TORCH_API_INC" -I"$PY_INC")
start=$(date +%s)
nvcc "${FLAGS[@]}" -c "$ROOT/csrc/cuda/batched_eigh.cu" -o "$OUT/batched_eigh.o"
nvcc "${FLAGS[@]}" -x c++ -c "$ROOT/csrc/faast_ops.cpp" -o "$OUT/faast_ops.o"
echo "check_cuda_sources: csrc/ compiles with $(nvcc --version | tail -1) in $(( $(date +%s) - start )) s"
