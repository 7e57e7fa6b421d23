// faast::batched_eigh on CUDA: one call decomposes the statistics S of every memory layer with cuSOLVER.
//
// Three routines, because cuSOLVER's batched solvers cover different sizes:
//   * syevj_batched  cusolverDnDsyevjBatched: Jacobi sweeps, one thread block per matrix; documented for n <= 32.
//   * syev_batched   cusolverDnXsyevBatched (cuSOLVER 11.7+, CUDA 12.6+): all matrices in one call; documented
//                    limit n * lda * batch <= INT32_MAX.
//   * syevd_streams  cusolverDnXsyevd per layer, spread over side streams so that small problems overlap; any size.
// "auto" takes the first that applies in that order. That order follows the documented limits only: it has not been
// timed on a GPU yet. lab/benchmarks/bench_eigh.py times all three against torch.linalg.eigh on the same batch; update
// choose() below when it has numbers.
//
// Two ops share one implementation:
//   * batched_eigh_info returns every layer's cuSOLVER `info` as a CPU int32 tensor and throws only for bad
//     arguments or a failed cuSOLVER/CUDA call. faast (python/faast/ops/_cuda_backend.py) checks the arguments before
//     calling it and turns a nonzero info into a Python error naming the layer, so that no data-dependent failure
//     has to unwind through this library (see csrc/README.md: the one crash seen on a GPU was a throw from here).
//   * batched_eigh checks info here and throws naming the first failing layer (the benchmark calls it).
//
// Every call runs on the current torch stream with memory from torch's caching allocator. Only float64 is accepted: a
// float32 eigensolver loses every direction below ~1e-5·λmax (docs/numerics.md §1); faast.ops upcasts first.
//
// Lifetimes: cuSOLVER reads its workspaces (device and host) and parameter objects while the queued work runs, so
// everything a call hands to cuSOLVER is held by one Pending object that is released only after the call has waited
// for its streams (the copy of info to the host), or, when an error unwinds the call, after synchronising them.
//
// Handles: one cuSOLVER handle per (thread, device, stream) from a small pool of our own, rebound to its stream on
// every use (torch's own pool is not exported by every torch build: the extension built against torch 2.11+cu130
// failed to load with an undefined at::cuda::getCurrentCUDASolverDnHandle on the first H100 run).

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cusolverDn.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

namespace faast {
namespace {

constexpr int64_t kJacobiMaxDim = 32;
constexpr int kSideStreams = 4;

#if defined(CUSOLVER_VERSION) && CUSOLVER_VERSION >= 11701
constexpr bool kHasSyevBatched = true;
#else
constexpr bool kHasSyevBatched = false;
#endif

// Every error leaves through fail() with a message already formatted (std::to_string, string concatenation), never
// through TORCH_CHECK's stream formatting of numbers: on the H100 image (lab/benchmarks/results/gpu_h100_run4.md) the two
// throws whose messages streamed integers crashed the process (SIGSEGV) while those streaming only strings raised.
[[noreturn]] void fail(const std::string& message) {
  TORCH_CHECK(false, message);
}

std::string sizes_text(at::IntArrayRef sizes) {
  std::string text = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(sizes[i]);
  }
  return text + "]";
}

#define FAAST_CUSOLVER(call, what)                                                                            \
  do {                                                                                                        \
    cusolverStatus_t status_ = (call);                                                                        \
    if (status_ != CUSOLVER_STATUS_SUCCESS) {                                                                 \
      fail(std::string("faast::batched_eigh: ") + (what) + " failed with cuSOLVER status " +                  \
           std::to_string(static_cast<int>(status_)));                                                        \
    }                                                                                                         \
  } while (0)

// cuSOLVER is column-major. A row-major symmetric matrix read column-major is its transpose, i.e. the same matrix,
// but its row-major lower triangle is the column-major upper one: pass UPPER to read only the lower triangle, as
// torch.linalg.eigh(UPLO="L") does. The eigenvectors come back as column-major columns = row-major rows, so the
// result is transposed to put them in columns.
constexpr cublasFillMode_t kLowerTriangleOfRowMajor = CUBLAS_FILL_MODE_UPPER;

enum class Routine { kSyevjBatched, kSyevBatched, kSyevdStreams };

const char* routine_name(Routine routine) {
  switch (routine) {
    case Routine::kSyevjBatched: return "syevj_batched";
    case Routine::kSyevBatched: return "syev_batched";
    default: return "syevd_streams";
  }
}

// Every argument check, before anything is allocated or queued: a bad argument raises here and nowhere later.
Routine check_arguments(const at::Tensor& gram, c10::string_view algorithm) {
  if (!gram.defined()) fail("faast::batched_eigh: gram must be a tensor, got an undefined one");
  if (!gram.is_cuda()) fail("faast::batched_eigh: gram must be a CUDA tensor, got one on " + gram.device().str());
  if (gram.layout() != at::kStrided) fail("faast::batched_eigh: gram must be a dense (strided) tensor");
  if (gram.dim() != 3 || gram.size(1) != gram.size(2)) {
    fail("faast::batched_eigh: gram must have shape [L, d, d], got " + sizes_text(gram.sizes()));
  }
  if (gram.scalar_type() != at::kDouble) {
    fail(std::string("faast::batched_eigh: gram must be float64 (a float32 eigensolver loses every direction below "
                     "~1e-5 of the largest eigenvalue; upcast first), got ") +
         c10::toString(gram.scalar_type()));
  }
  const int64_t batch = gram.size(0);
  const int64_t n = gram.size(1);
  const bool is_auto = algorithm == "auto";
  const bool known = is_auto || algorithm == "syevj_batched" || algorithm == "syev_batched" ||
                     algorithm == "syevd_streams";
  if (!known) {
    fail("faast::batched_eigh: algorithm must be auto, syevj_batched, syev_batched or syevd_streams; got " +
         std::string(algorithm));
  }
  // n * n * batch cannot overflow int64 for any tensor that fits in memory; these are the routines' own limits.
  const bool jacobi_fits = n <= kJacobiMaxDim && batch <= INT_MAX;
  const bool batched_fits = kHasSyevBatched && n * n * batch <= INT_MAX;
  if (is_auto) {
    if (jacobi_fits) return Routine::kSyevjBatched;
    if (batched_fits) return Routine::kSyevBatched;
    return Routine::kSyevdStreams;
  }
  if (algorithm == "syevj_batched") {
    if (!jacobi_fits) {
      fail("faast::batched_eigh: syevj_batched supports d <= " + std::to_string(kJacobiMaxDim) +
           " and L <= 2^31 - 1, got L = " + std::to_string(batch) + ", d = " + std::to_string(n));
    }
    return Routine::kSyevjBatched;
  }
  if (algorithm == "syev_batched") {
    if (!kHasSyevBatched) {
      fail("faast::batched_eigh: syev_batched needs cuSOLVER 11.7 (CUDA 12.6) or newer; this build has an older one");
    }
    if (!batched_fits) {
      fail("faast::batched_eigh: syev_batched supports L * d * d <= 2^31 - 1, got " + std::to_string(batch) + " * " +
           std::to_string(n) + "^2");
    }
    return Routine::kSyevBatched;
  }
  return Routine::kSyevdStreams;
}

// One handle per (thread, device, stream), created on first use and kept for the life of the process (destroying
// handles at exit, after the CUDA context may be gone, is what crashes; torch's pool keeps them alive for the same
// reason). Per thread, because a cuSOLVER handle must not be used by two host threads at once. Rebound on every use:
// a stream can be destroyed and its address reused by a new one.
cusolverDnHandle_t solver_handle(cudaStream_t stream) {
  static std::mutex lock;
  static std::map<std::tuple<std::thread::id, int, cudaStream_t>, cusolverDnHandle_t> pool;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  cusolverDnHandle_t handle = nullptr;
  {
    std::lock_guard<std::mutex> guard(lock);
    auto key = std::make_tuple(std::this_thread::get_id(), device, stream);
    auto found = pool.find(key);
    if (found != pool.end()) {
      handle = found->second;
    } else {
      FAAST_CUSOLVER(cusolverDnCreate(&handle), "cusolverDnCreate");
      pool.emplace(key, handle);
    }
  }
  FAAST_CUSOLVER(cusolverDnSetStream(handle, stream), "cusolverDnSetStream");
  return handle;
}

struct ParamsDeleter {
  void operator()(cusolverDnParams_t p) const { cusolverDnDestroyParams(p); }
};
using Params = std::unique_ptr<std::remove_pointer_t<cusolverDnParams_t>, ParamsDeleter>;

struct SyevjInfoDeleter {
  void operator()(syevjInfo_t p) const { cusolverDnDestroySyevjInfo(p); }
};
using SyevjInfo = std::unique_ptr<std::remove_pointer_t<syevjInfo_t>, SyevjInfoDeleter>;

// Everything cuSOLVER may still touch while the queued work runs. Members are destroyed after the destructor's body,
// i.e. after the streams are synchronised when the call did not get as far as waiting for them.
struct Pending {
  std::vector<cudaStream_t> streams;
  std::vector<at::Tensor> device_buffers;
  std::vector<std::unique_ptr<char[]>> host_buffers;
  std::vector<Params> params;
  std::vector<SyevjInfo> syevj;
  bool finished = false;

  Pending() = default;
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  ~Pending() {
    if (!finished) {
      for (cudaStream_t stream : streams) {
        (void)cudaStreamSynchronize(stream);  // on an error path already: a second error is not reported
      }
    }
  }

  cusolverDnParams_t new_params() {
    cusolverDnParams_t raw = nullptr;
    FAAST_CUSOLVER(cusolverDnCreateParams(&raw), "cusolverDnCreateParams");
    params.emplace_back(raw);
    return raw;
  }
  syevjInfo_t new_syevj_info() {
    syevjInfo_t raw = nullptr;
    FAAST_CUSOLVER(cusolverDnCreateSyevjInfo(&raw), "cusolverDnCreateSyevjInfo");
    syevj.emplace_back(raw);
    return raw;
  }
  // Allocated on the current stream, so the caching allocator ties the block to the stream that uses it.
  void* device_bytes(size_t bytes, const at::Tensor& like) {
    device_buffers.push_back(
        at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, like.options().dtype(at::kByte)));
    return device_buffers.back().data_ptr();
  }
  void* host_bytes(size_t bytes) {
    host_buffers.emplace_back(new char[std::max<size_t>(bytes, 1)]);
    return host_buffers.back().get();
  }
};

// The private buffers the routines write: a [L, d, d] contiguous (decomposed in place), w [L, d], info [L] int32,
// all on one device. Checked again here so that a future caller cannot hand cuSOLVER a strided view.
void check_buffers(const at::Tensor& a, const at::Tensor& w, const at::Tensor& info) {
  TORCH_INTERNAL_ASSERT(a.is_contiguous() && a.dim() == 3 && a.size(1) == a.size(2) &&
                        a.scalar_type() == at::kDouble);
  TORCH_INTERNAL_ASSERT(w.is_contiguous() && w.dim() == 2 && w.size(0) == a.size(0) && w.size(1) == a.size(1) &&
                        w.scalar_type() == at::kDouble && w.device() == a.device());
  TORCH_INTERNAL_ASSERT(info.is_contiguous() && info.dim() == 1 && info.size(0) == a.size(0) &&
                        info.scalar_type() == at::kInt && info.device() == a.device());
}

void syevj_batched(at::Tensor& a, at::Tensor& w, at::Tensor& info, Pending& pending) {
  const int n = static_cast<int>(a.size(1));
  const int batch = static_cast<int>(a.size(0));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  pending.streams.push_back(stream);
  cusolverDnHandle_t handle = solver_handle(stream);
  syevjInfo_t params = pending.new_syevj_info();
  double* pa = a.data_ptr<double>();
  double* pw = w.data_ptr<double>();
  int lwork = 0;  // in doubles
  FAAST_CUSOLVER(cusolverDnDsyevjBatched_bufferSize(handle, CUSOLVER_EIG_MODE_VECTOR, kLowerTriangleOfRowMajor, n, pa,
                                                    n, pw, &lwork, params, batch),
                 "cusolverDnDsyevjBatched_bufferSize");
  if (lwork < 0) fail("faast::batched_eigh: cusolverDnDsyevjBatched_bufferSize returned lwork = " + std::to_string(lwork));
  auto* work = static_cast<double*>(pending.device_bytes(static_cast<size_t>(lwork) * sizeof(double), a));
  FAAST_CUSOLVER(cusolverDnDsyevjBatched(handle, CUSOLVER_EIG_MODE_VECTOR, kLowerTriangleOfRowMajor, n, pa, n, pw,
                                         work, lwork, info.data_ptr<int>(), params, batch),
                 "cusolverDnDsyevjBatched");
}

#if defined(CUSOLVER_VERSION) && CUSOLVER_VERSION >= 11701
void syev_batched(at::Tensor& a, at::Tensor& w, at::Tensor& info, Pending& pending) {
  const int64_t n = a.size(1);
  const int64_t batch = a.size(0);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  pending.streams.push_back(stream);
  cusolverDnHandle_t handle = solver_handle(stream);
  cusolverDnParams_t params = pending.new_params();
  size_t device_size = 0, host_size = 0;
  FAAST_CUSOLVER(cusolverDnXsyevBatched_bufferSize(handle, params, CUSOLVER_EIG_MODE_VECTOR, kLowerTriangleOfRowMajor,
                                                   n, CUDA_R_64F, a.data_ptr(), n, CUDA_R_64F, w.data_ptr(),
                                                   CUDA_R_64F, &device_size, &host_size, batch),
                 "cusolverDnXsyevBatched_bufferSize");
  void* device_work = pending.device_bytes(device_size, a);
  void* host_work = pending.host_bytes(host_size);
  FAAST_CUSOLVER(cusolverDnXsyevBatched(handle, params, CUSOLVER_EIG_MODE_VECTOR, kLowerTriangleOfRowMajor, n,
                                        CUDA_R_64F, a.data_ptr(), n, CUDA_R_64F, w.data_ptr(), CUDA_R_64F,
                                        device_work, device_size, host_work, host_size, info.data_ptr<int>(), batch),
                 "cusolverDnXsyevBatched");
}
#else
void syev_batched(at::Tensor&, at::Tensor&, at::Tensor&, Pending&) {
  fail("faast::batched_eigh: syev_batched needs cuSOLVER 11.7 (CUDA 12.6) or newer");
}
#endif

// One Xsyevd per layer, layer i on side stream i mod kSideStreams. Each side stream has its own handle (bound to it),
// parameters and workspaces, reused by its layers one after another in stream order; no two streams share anything
// cuSOLVER writes.
void syevd_streams(at::Tensor& a, at::Tensor& w, at::Tensor& info, Pending& pending) {
  const int64_t n = a.size(1);
  const int64_t batch = a.size(0);
  auto main_stream = at::cuda::getCurrentCUDAStream();
  at::cuda::CUDAEvent inputs_ready;
  inputs_ready.record(main_stream);

  struct Lane {
    c10::cuda::CUDAStream stream;
    cusolverDnHandle_t handle;
    cusolverDnParams_t params;
    void* device_work = nullptr;
    size_t device_size = 0;
    void* host_work = nullptr;
    size_t host_size = 0;
  };
  std::vector<Lane> lanes;
  const int64_t lane_count = std::min<int64_t>(kSideStreams, batch);
  for (int64_t i = 0; i < lane_count; ++i) {
    auto stream = at::cuda::getStreamFromPool(false, a.get_device());
    pending.streams.push_back(stream.stream());
    inputs_ready.block(stream);
    // a, w and info were allocated on the main stream and are written on this one: tell the caching allocator, so
    // that their blocks are not reused before this stream's work is done even if an error frees them early.
    for (const at::Tensor* t : {&a, &w, &info}) {
      c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), stream);
    }
    lanes.push_back(Lane{stream, solver_handle(stream.stream()), pending.new_params()});
  }

  const int64_t elem = a.element_size();
  for (int64_t layer = 0; layer < batch; ++layer) {
    Lane& lane = lanes[layer % lane_count];
    c10::cuda::CUDAStreamGuard guard(lane.stream);
    char* pa = static_cast<char*>(a.data_ptr()) + layer * n * n * elem;
    char* pw = static_cast<char*>(w.data_ptr()) + layer * n * elem;
    size_t device_size = 0, host_size = 0;
    FAAST_CUSOLVER(cusolverDnXsyevd_bufferSize(lane.handle, lane.params, CUSOLVER_EIG_MODE_VECTOR,
                                               kLowerTriangleOfRowMajor, n, CUDA_R_64F, pa, n, CUDA_R_64F, pw,
                                               CUDA_R_64F, &device_size, &host_size),
                   "cusolverDnXsyevd_bufferSize");
    // Every layer has the same n, so this allocates once per lane; a larger request gets a new buffer (the old one
    // stays in `pending` until the call is finished: queued work may still use it).
    if (lane.device_work == nullptr || device_size > lane.device_size) {
      lane.device_work = pending.device_bytes(device_size, a);
      lane.device_size = device_size;
    }
    if (lane.host_work == nullptr || host_size > lane.host_size) {
      lane.host_work = pending.host_bytes(host_size);
      lane.host_size = host_size;
    }
    FAAST_CUSOLVER(cusolverDnXsyevd(lane.handle, lane.params, CUSOLVER_EIG_MODE_VECTOR, kLowerTriangleOfRowMajor, n,
                                    CUDA_R_64F, pa, n, CUDA_R_64F, pw, CUDA_R_64F, lane.device_work, device_size,
                                    lane.host_work, host_size, info.data_ptr<int>() + layer),
                   "cusolverDnXsyevd");
  }
  for (auto& lane : lanes) {
    at::cuda::CUDAEvent done;
    done.record(lane.stream);
    done.block(main_stream);
  }
}

// (λ [L, d], eigenvectors [L, d, d] as columns, info [L] int32 on the CPU) of gram, whose arguments check_arguments
// accepted with `routine`. The copy of info to the host waits for every stream of the call; then the workspaces go.
std::tuple<at::Tensor, at::Tensor, at::Tensor> decompose(const at::Tensor& gram, Routine routine) {
  c10::cuda::CUDAGuard device_guard(gram.device());
  const int64_t batch = gram.size(0);
  const int64_t n = gram.size(1);
  // Decomposed in place, so work on a private contiguous copy (one copy whatever gram's strides).
  at::Tensor a = at::empty({batch, n, n}, gram.options());
  at::Tensor w = at::empty({batch, n}, gram.options());
  if (batch == 0 || n == 0) {
    return {w, a.transpose(1, 2), at::zeros({batch}, gram.options().dtype(at::kInt).device(at::kCPU))};
  }
  a.copy_(gram);
  at::Tensor info = at::zeros({batch}, gram.options().dtype(at::kInt));
  check_buffers(a, w, info);
  at::Tensor host_info;
  {
    Pending pending;
    if (routine == Routine::kSyevjBatched) {
      syevj_batched(a, w, info, pending);
    } else if (routine == Routine::kSyevBatched) {
      syev_batched(a, w, info, pending);
    } else {
      syevd_streams(a, w, info, pending);
    }
    host_info = info.to(at::kCPU);  // blocking copy on the main stream, which waits for every side stream
    pending.finished = true;
  }
  return {w, a.transpose(1, 2), host_info};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batched_eigh_info_cuda(const at::Tensor& gram,
                                                                      c10::string_view algorithm) {
  return decompose(gram, check_arguments(gram, algorithm));
}

std::tuple<at::Tensor, at::Tensor> batched_eigh_cuda(const at::Tensor& gram, c10::string_view algorithm) {
  const Routine routine = check_arguments(gram, algorithm);
  auto [w, vectors, info] = decompose(gram, routine);
  auto values = info.accessor<int, 1>();
  for (int64_t layer = 0; layer < info.size(0); ++layer) {
    const int v = values[layer];
    if (v != 0) {
      fail(std::string("faast::batched_eigh: ") + routine_name(routine) + " failed on layer " + std::to_string(layer) +
           " (info = " + std::to_string(v) +
           (v > 0 ? ": did not converge; the statistics may hold NaN/Inf or be far from symmetric)"
                  : ": invalid argument)"));
    }
  }
  return {w, vectors};
}

}  // namespace

TORCH_LIBRARY_IMPL(faast, CUDA, m) {
  m.impl("batched_eigh", &batched_eigh_cuda);
  m.impl("batched_eigh_info", &batched_eigh_info_cuda);
}

}  // namespace faast
