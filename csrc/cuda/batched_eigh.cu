// faast::batched_eigh on CUDA: one call decomposes the statistics S of every memory layer with cuSOLVER.
//
// Three routines, because cuSOLVER's batched solvers cover different sizes:
//   * syevj_batched  cusolverDn{S,D}syevjBatched: Jacobi sweeps, one thread block per matrix; documented for n <= 32.
//   * syev_batched   cusolverDnXsyevBatched (cuSOLVER 11.7+, CUDA 12.6+): all matrices in one call; documented
//                    limit n * lda * batch <= INT32_MAX.
//   * syevd_streams  cusolverDnXsyevd per layer, spread over side streams so that small problems overlap; any size.
// "auto" takes the first that applies in that order. That order follows the documented limits only: it has not been
// timed on a GPU yet (no GPU was available when this was written). benchmarks/bench_eigh.py times all three against
// torch.linalg.eigh on the same batch; update choose() below when it has numbers.
//
// Every call runs on the current torch stream with memory from torch's caching allocator, and checks every layer's
// `info`, naming the first layer that failed. Only float64 is accepted: a float32 eigensolver loses every direction
// below ~1e-5·λmax (docs/numerics.md §1); faast.ops upcasts before calling.
//
// Handles: one cuSOLVER handle per (device, stream) from a small pool of our own, bound to its stream once (torch's
// own pool is not exported by every torch build: the extension built against torch 2.11+cu130 failed to load with an
// undefined at::cuda::getCurrentCUDASolverDnHandle on the first H100 run of benchmarks/gpu_check.py). Every other cuSOLVER object is held by an RAII guard, so an error
// thrown by TORCH_CHECK releases it.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cusolverDn.h>
#include <torch/library.h>

#include <climits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace faast {
namespace {

constexpr int64_t kJacobiMaxDim = 32;
constexpr int kSideStreams = 4;

#define FAAST_CUSOLVER(call, what)                                                                          \
  do {                                                                                                      \
    cusolverStatus_t status_ = (call);                                                                      \
    TORCH_CHECK(status_ == CUSOLVER_STATUS_SUCCESS, "faast::batched_eigh: ", what, " failed with cuSOLVER " \
                "status ", static_cast<int>(status_));                                                      \
  } while (0)

// cuSOLVER is column-major. A row-major symmetric matrix read column-major is its transpose, i.e. the same matrix,
// but its row-major lower triangle is the column-major upper one: pass UPPER to read only the lower triangle, as
// torch.linalg.eigh(UPLO="L") does. The eigenvectors come back as column-major columns = row-major rows, so the
// result is transposed to put them in columns.
constexpr cublasFillMode_t kLowerTriangleOfRowMajor = CUBLAS_FILL_MODE_UPPER;

// One handle per (device, stream), created on first use and kept for the life of the process (destroying handles at
// exit, after the CUDA context may be gone, is what crashes; torch's pool keeps them alive for the same reason).
cusolverDnHandle_t solver_handle(cudaStream_t stream) {
  static std::mutex lock;
  static std::map<std::pair<int, cudaStream_t>, cusolverDnHandle_t> pool;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> guard(lock);
  auto key = std::make_pair(device, stream);
  auto found = pool.find(key);
  if (found != pool.end()) return found->second;
  cusolverDnHandle_t handle = nullptr;
  FAAST_CUSOLVER(cusolverDnCreate(&handle), "cusolverDnCreate");
  cusolverStatus_t bound = cusolverDnSetStream(handle, stream);
  if (bound != CUSOLVER_STATUS_SUCCESS) {
    cusolverDnDestroy(handle);
    FAAST_CUSOLVER(bound, "cusolverDnSetStream");
  }
  pool.emplace(key, handle);
  return handle;
}

cusolverDnHandle_t current_handle() { return solver_handle(at::cuda::getCurrentCUDAStream().stream()); }

struct ParamsDeleter {
  void operator()(cusolverDnParams_t p) const { cusolverDnDestroyParams(p); }
};
using Params = std::unique_ptr<std::remove_pointer_t<cusolverDnParams_t>, ParamsDeleter>;

Params make_params() {
  cusolverDnParams_t raw = nullptr;
  FAAST_CUSOLVER(cusolverDnCreateParams(&raw), "cusolverDnCreateParams");
  return Params(raw);
}

struct SyevjInfoDeleter {
  void operator()(syevjInfo_t p) const { cusolverDnDestroySyevjInfo(p); }
};
using SyevjInfo = std::unique_ptr<std::remove_pointer_t<syevjInfo_t>, SyevjInfoDeleter>;

void check_info(const at::Tensor& info, const char* routine) {
  auto host = info.to(at::kCPU);  // synchronises the stream: the one host round trip of the call
  auto values = host.accessor<int, 1>();
  for (int64_t layer = 0; layer < host.size(0); ++layer) {
    int v = values[layer];
    TORCH_CHECK(v == 0, "faast::batched_eigh: ", routine, " failed on layer ", layer, " (info = ", v,
                v > 0 ? ": did not converge; the statistics may hold NaN/Inf or be far from symmetric)"
                      : ": invalid argument)");
  }
}

template <typename scalar_t>
void syevj_batched(at::Tensor& a, at::Tensor& w, at::Tensor& info) {
  const int n = static_cast<int>(a.size(1));
  const int batch = static_cast<int>(a.size(0));
  auto handle = current_handle();
  syevjInfo_t raw_params = nullptr;
  FAAST_CUSOLVER(cusolverDnCreateSyevjInfo(&raw_params), "cusolverDnCreateSyevjInfo");
  SyevjInfo owner(raw_params);
  syevjInfo_t params = owner.get();
  int lwork = 0;
  scalar_t* pa = a.data_ptr<scalar_t>();
  scalar_t* pw = w.data_ptr<scalar_t>();
  if constexpr (std::is_same_v<scalar_t, double>) {
    FAAST_CUSOLVER(cusolverDnDsyevjBatched_bufferSize(handle, CUSOLVER_EIG_MODE_VECTOR, kLowerTriangleOfRowMajor, n,
                                                      pa, n, pw, &lwork, params, batch),
                   "cusolverDnDsyevjBatched_bufferSize");
  } else {
    FAAST_CUSOLVER(cusolverDnSsyevjBatched_bufferSize(handle, CUSOLVER_EIG_MODE_VECTOR, kLowerTriangleOfRowMajor, n,
                                                      pa, n, pw, &lwork, params, batch),
                   "cusolverDnSsyevjBatched_bufferSize");
  }
  auto work = at::empty({std::max(lwork, 1)}, a.options());
  if constexpr (std::is_same_v<scalar_t, double>) {
    FAAST_CUSOLVER(cusolverDnDsyevjBatched(handle, CUSOLVER_EIG_MODE_VECTOR, kLowerTriangleOfRowMajor, n, pa, n, pw,
                                           work.data_ptr<scalar_t>(), lwork, info.data_ptr<int>(), params, batch),
                   "cusolverDnDsyevjBatched");
  } else {
    FAAST_CUSOLVER(cusolverDnSsyevjBatched(handle, CUSOLVER_EIG_MODE_VECTOR, kLowerTriangleOfRowMajor, n, pa, n, pw,
                                           work.data_ptr<scalar_t>(), lwork, info.data_ptr<int>(), params, batch),
                   "cusolverDnSsyevjBatched");
  }
}

cudaDataType cuda_type(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? CUDA_R_64F : CUDA_R_32F; }

#if defined(CUSOLVER_VERSION) && CUSOLVER_VERSION >= 11701
constexpr bool kHasSyevBatched = true;

void syev_batched(at::Tensor& a, at::Tensor& w, at::Tensor& info) {
  const int64_t n = a.size(1);
  const int64_t batch = a.size(0);
  auto handle = current_handle();
  Params owner = make_params();
  cusolverDnParams_t params = owner.get();
  const cudaDataType type = cuda_type(a);
  size_t device_bytes = 0, host_bytes = 0;
  FAAST_CUSOLVER(cusolverDnXsyevBatched_bufferSize(handle, params, CUSOLVER_EIG_MODE_VECTOR, kLowerTriangleOfRowMajor,
                                                   n, type, a.data_ptr(), n, type, w.data_ptr(), type, &device_bytes,
                                                   &host_bytes, batch),
                 "cusolverDnXsyevBatched_bufferSize");
  auto device_work = at::empty({static_cast<int64_t>(std::max<size_t>(device_bytes, 1))}, a.options().dtype(at::kByte));
  std::vector<char> host_work(std::max<size_t>(host_bytes, 1));
  FAAST_CUSOLVER(cusolverDnXsyevBatched(handle, params, CUSOLVER_EIG_MODE_VECTOR, kLowerTriangleOfRowMajor, n, type,
                                        a.data_ptr(), n, type, w.data_ptr(), type, device_work.data_ptr(),
                                        device_bytes, host_work.data(), host_bytes, info.data_ptr<int>(), batch),
                 "cusolverDnXsyevBatched");
}
#else
constexpr bool kHasSyevBatched = false;

void syev_batched(at::Tensor&, at::Tensor&, at::Tensor&) {
  TORCH_CHECK(false, "faast::batched_eigh: syev_batched needs cuSOLVER 11.7 (CUDA 12.6) or newer; this build has ",
              "an older one");
}
#endif

void syevd_streams(at::Tensor& a, at::Tensor& w, at::Tensor& info) {
  const int64_t n = a.size(1);
  const int64_t batch = a.size(0);
  const cudaDataType type = cuda_type(a);
  auto main_stream = at::cuda::getCurrentCUDAStream();
  at::cuda::CUDAEvent inputs_ready;
  inputs_ready.record(main_stream);
  std::vector<c10::cuda::CUDAStream> streams;
  for (int i = 0; i < std::min<int64_t>(kSideStreams, batch); ++i) {
    streams.push_back(at::cuda::getStreamFromPool(false, a.get_device()));
    inputs_ready.block(streams.back());
    // The outputs were allocated on the main stream and are written on this one: tell the caching allocator, so
    // their blocks are not reused before this stream's work is done.
    for (const at::Tensor* t : {&a, &w, &info}) {
      c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), streams.back());
    }
  }
  const int64_t elem = a.element_size();
  for (int64_t layer = 0; layer < batch; ++layer) {
    auto& stream = streams[layer % streams.size()];
    c10::cuda::CUDAStreamGuard guard(stream);
    auto handle = solver_handle(stream.stream());  // bound to `stream`
    Params owner = make_params();
    cusolverDnParams_t params = owner.get();
    char* pa = static_cast<char*>(a.data_ptr()) + layer * n * n * elem;
    char* pw = static_cast<char*>(w.data_ptr()) + layer * n * elem;
    size_t device_bytes = 0, host_bytes = 0;
    FAAST_CUSOLVER(cusolverDnXsyevd_bufferSize(handle, params, CUSOLVER_EIG_MODE_VECTOR, kLowerTriangleOfRowMajor, n,
                                               type, pa, n, type, pw, type, &device_bytes, &host_bytes),
                   "cusolverDnXsyevd_bufferSize");
    // Allocated while `stream` is current, so the caching allocator ties the workspace to it.
    auto device_work =
        at::empty({static_cast<int64_t>(std::max<size_t>(device_bytes, 1))}, a.options().dtype(at::kByte));
    std::vector<char> host_work(std::max<size_t>(host_bytes, 1));
    FAAST_CUSOLVER(cusolverDnXsyevd(handle, params, CUSOLVER_EIG_MODE_VECTOR, kLowerTriangleOfRowMajor, n, type, pa, n,
                                    type, pw, type, device_work.data_ptr(), device_bytes, host_work.data(),
                                    host_bytes, info.data_ptr<int>() + layer),
                   "cusolverDnXsyevd");
  }
  for (auto& stream : streams) {
    at::cuda::CUDAEvent done;
    done.record(stream);
    done.block(main_stream);
  }
}

std::string choose(const std::string& algorithm, int64_t n, int64_t batch) {
  if (algorithm != "auto") {
    TORCH_CHECK(algorithm == "syevj_batched" || algorithm == "syev_batched" || algorithm == "syevd_streams",
                "faast::batched_eigh: algorithm must be auto, syevj_batched, syev_batched or syevd_streams; got ",
                algorithm);
    TORCH_CHECK(algorithm != "syevj_batched" || n <= kJacobiMaxDim,
                "faast::batched_eigh: syevj_batched supports d <= ", kJacobiMaxDim, ", got d = ", n);
    TORCH_CHECK(algorithm != "syev_batched" || n * n * batch <= INT_MAX,
                "faast::batched_eigh: syev_batched supports L * d * d <= 2^31 - 1, got ", batch, " * ", n, "^2");
    return algorithm;
  }
  if (n <= kJacobiMaxDim) return "syevj_batched";
  if (kHasSyevBatched && n * n * batch <= INT_MAX) return "syev_batched";
  return "syevd_streams";
}

std::tuple<at::Tensor, at::Tensor> batched_eigh_cuda(const at::Tensor& gram, c10::string_view algorithm) {
  TORCH_CHECK(gram.is_cuda(), "faast::batched_eigh: gram must be a CUDA tensor, got one on ", gram.device());
  TORCH_CHECK(gram.dim() == 3 && gram.size(1) == gram.size(2),
              "faast::batched_eigh: gram must have shape [L, d, d], got ", gram.sizes());
  TORCH_CHECK(gram.scalar_type() == at::kDouble,
              "faast::batched_eigh: gram must be float64 (a float32 eigensolver loses every direction below ~1e-5 of "
              "the largest eigenvalue; upcast first), got ", gram.scalar_type());
  c10::cuda::CUDAGuard device_guard(gram.device());
  const int64_t batch = gram.size(0);
  const int64_t n = gram.size(1);
  // Decomposed in place, so work on a private contiguous copy.
  at::Tensor a = gram.contiguous().clone();
  at::Tensor w = at::empty({batch, n}, gram.options());
  if (batch == 0 || n == 0) {
    return {w, a};
  }
  at::Tensor info = at::zeros({batch}, gram.options().dtype(at::kInt));
  const std::string routine = choose(std::string(algorithm), n, batch);
  if (routine == "syevj_batched") {
    syevj_batched<double>(a, w, info);
  } else if (routine == "syev_batched") {
    syev_batched(a, w, info);
  } else {
    syevd_streams(a, w, info);
  }
  check_info(info, routine.c_str());
  return {w, a.transpose(1, 2)};
}

}  // namespace

TORCH_LIBRARY_IMPL(faast, CUDA, m) { m.impl("batched_eigh", &batched_eigh_cuda); }

}  // namespace faast
