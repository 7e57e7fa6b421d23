// faast._C: the schema of the native ops, and the module stub that lets `import faast._C` load this library.
//
// The op is registered with TORCH_LIBRARY (no pybind): Python calls torch.ops.faast.batched_eigh, and its fake
// (meta) implementation is registered in python/faast/ops/_cuda_backend.py. The CUDA kernel is registered in
// cuda/batched_eigh.cu.

#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import faast._C` needs a module init function; the ops register themselves through static initialisers when the
// shared library is loaded, so the module itself is empty.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(faast, m) {
  // gram [L, d, d] float64 symmetric, only its lower triangle read -> (lambda [L, d] ascending,
  // eigenvectors [L, d, d] as columns), like torch.linalg.eigh. algorithm: "auto", "syevj_batched",
  // "syev_batched" or "syevd_streams" (the benchmark forces each one).
  m.def("batched_eigh(Tensor gram, str algorithm=\"auto\") -> (Tensor, Tensor)");
}
