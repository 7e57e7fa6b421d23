// faast._C: the schema of the native ops, and the module stub that lets `import faast._C` load this library.
//
// The ops are registered with TORCH_LIBRARY (no pybind): Python calls torch.ops.faast.*, and their fake (meta)
// implementations are registered in python/faast/ops/_cuda_backend.py, which tests/test_native.py checks against the
// schema strings below. The CUDA kernels are registered in cuda/batched_eigh.cu.
//
// The module records what it was built against (torch and CUDA versions, cuSOLVER, compiler) as string attributes:
// python/faast/ops/_cuda_backend.py compares them with the running torch at load and reports a mismatch as the
// reason the backend is unavailable, instead of calling into a library built for another torch.

#include <Python.h>
#include <cuda_runtime_api.h>
#include <cusolver_common.h>
#include <torch/library.h>
#include <torch/version.h>

#include <string>

namespace {

#define FAAST_STRINGIFY_(x) #x
#define FAAST_STRINGIFY(x) FAAST_STRINGIFY_(x)

constexpr const char* kTorchVersion =
    FAAST_STRINGIFY(TORCH_VERSION_MAJOR) "." FAAST_STRINGIFY(TORCH_VERSION_MINOR) "." FAAST_STRINGIFY(
        TORCH_VERSION_PATCH);

std::string cuda_version() {  // CUDART_VERSION is 1000 * major + 10 * minor, e.g. 13000 -> "13.0"
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
}

std::string cusolver_version() {
  return std::to_string(CUSOLVER_VER_MAJOR) + "." + std::to_string(CUSOLVER_VER_MINOR) + "." +
         std::to_string(CUSOLVER_VER_PATCH);
}

#if defined(__clang__)
constexpr const char* kCompiler = "clang " __clang_version__;
#elif defined(__GNUC__)
constexpr const char* kCompiler = "gcc " __VERSION__;
#else
constexpr const char* kCompiler = "unknown";
#endif

}  // namespace

extern "C" {
// `import faast._C` needs a module init function; the ops register themselves through static initialisers when the
// shared library is loaded, so the module holds only the build record.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "faast._C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  const std::string cuda = cuda_version();
  const std::string cusolver = cusolver_version();
  if (PyModule_AddStringConstant(module, "torch_version", kTorchVersion) < 0 ||
      PyModule_AddStringConstant(module, "cuda_version", cuda.c_str()) < 0 ||
      PyModule_AddStringConstant(module, "cusolver_version", cusolver.c_str()) < 0 ||
      PyModule_AddStringConstant(module, "compiler", kCompiler) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}

TORCH_LIBRARY(faast, m) {
  // gram [L, d, d] float64 symmetric, only its lower triangle read -> (lambda [L, d] ascending, eigenvectors
  // [L, d, d] as columns), like torch.linalg.eigh; raises naming the first layer cuSOLVER could not decompose.
  // algorithm: "auto", "syevj_batched", "syev_batched" or "syevd_streams" (the benchmark forces each one).
  m.def("batched_eigh(Tensor gram, str algorithm=\"auto\") -> (Tensor, Tensor)");
  // The same, plus every layer's cuSOLVER info ([L] int32, on the CPU; 0 = decomposed) instead of raising on it:
  // faast's backend reads it and raises in Python.
  m.def("batched_eigh_info(Tensor gram, str algorithm=\"auto\") -> (Tensor, Tensor, Tensor)");
}
