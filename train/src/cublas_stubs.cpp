// The cuBLAS entry points the CUDA GPT (gpt_cuda_passes.cpp) calls, loaded on
// first use instead of linked (Note [CUDA libraries load on first use] in
// common/src/shared_library.cpp). Each definition below has cublas_api.h's
// name and signature (cublas_v2.h maps cublasSgemm and friends to the _v2
// names) and forwards to libcublas's function; a call made when the library
// could not be loaded returns CUBLAS_STATUS_NOT_INITIALIZED (Context::create
// calls load_cublas() first, which says why).
#include <cublas_v2.h>

#include <string>

#include "gpt_cuda.h"
#include "tierzero/common/shared_library.h"

// X(return type, name, (parameters), (arguments), value when not loaded)
#define TZ_CUBLAS_ENTRY_POINTS(X)                                                                                  \
  X(cublasStatus_t, cublasCreate_v2, (cublasHandle_t * handle), (handle), CUBLAS_STATUS_NOT_INITIALIZED)           \
  X(cublasStatus_t, cublasDestroy_v2, (cublasHandle_t handle), (handle), CUBLAS_STATUS_NOT_INITIALIZED)            \
  X(cublasStatus_t, cublasSetStream_v2, (cublasHandle_t handle, cudaStream_t stream), (handle, stream),            \
    CUBLAS_STATUS_NOT_INITIALIZED)                                                                                 \
  X(cublasStatus_t, cublasSetMathMode, (cublasHandle_t handle, cublasMath_t mode), (handle, mode),                 \
    CUBLAS_STATUS_NOT_INITIALIZED)                                                                                 \
  X(const char*, cublasGetStatusName, (cublasStatus_t status), (status), "cuBLAS is not loaded")                   \
  X(const char*, cublasGetStatusString, (cublasStatus_t status), (status), "cuBLAS is not loaded")                 \
  X(cublasStatus_t, cublasSgemm_v2,                                                                                \
    (cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float* alpha,   \
     const float* a, int lda, const float* b, int ldb, const float* beta, float* c, int ldc),                      \
    (handle, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc), CUBLAS_STATUS_NOT_INITIALIZED)                 \
  X(cublasStatus_t, cublasSgemmStridedBatched,                                                                     \
    (cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float* alpha,   \
     const float* a, int lda, long long stride_a, const float* b, int ldb, long long stride_b, const float* beta,  \
     float* c, int ldc, long long stride_c, int count),                                                            \
    (handle, ta, tb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc, stride_c, count),           \
    CUBLAS_STATUS_NOT_INITIALIZED)

namespace tz::train::cuda {
namespace {

TZ_LAZY_API(CublasApi, TZ_CUBLAS_ENTRY_POINTS);
CublasApi api;

LazyLibrary& cublas_library() {
  static LazyLibrary library("cuBLAS", "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR), TIERZERO_CUDA_LIBRARY_DIR,
                             [](const SharedLibrary& lib) { return api.resolve(lib); });
  return library;
}

}  // namespace

Status load_cublas() { return cublas_library().load(); }

}  // namespace tz::train::cuda

// Hidden: neither the executable nor the Python module exports them, so they
// cannot stand in for another copy of cuBLAS loaded in the same process.
#pragma GCC visibility push(hidden)
extern "C" {
#define TZ_CUBLAS_FORWARD(ret, name, params, args, failed) \
  TZ_FORWARD_LAZY(tz::train::cuda::cublas_library(), tz::train::cuda::api, failed, ret, name, params, args)
TZ_CUBLAS_ENTRY_POINTS(TZ_CUBLAS_FORWARD)
#undef TZ_CUBLAS_FORWARD
}
#pragma GCC visibility pop
