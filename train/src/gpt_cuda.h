// Private to train/: the GPT on CUDA, the device twin of passes.h. Activations
// are fp32 device memory; weights come in as fp32 device arrays (the trainer
// casts each gathered 16-bit block into one first); matmuls are cuBLAS SGEMMs
// on one stream and one handle owned by a Context. The formulas, the order of
// the passes and the buffers mirror passes.cpp, so the two implementations
// compute the same function (tests/train/gpt_cuda_test.cpp compares them).
//
//   TZ_ASSIGN_OR_RETURN(auto ctx, cuda::Context::create({.tf32 = false}));
//   cuda::Workspace ws;
//   TZ_TRY(ws.resize(shape, cfg.layers));
//   TZ_TRY(cuda::upload_tokens(*ctx, batch, ws));
//   TZ_TRY(cuda::embed_forward(*ctx, shape, layout.blocks[0], d_w_embed, ws.tokens.data(), ws.stream(0)));
//   ... layer_forward, head, layer_backward, embed_backward as in passes.h
//
// Every function enqueues on ctx.stream() and returns without waiting, except
// head(), which waits for the loss. Errors name the CUDA or cuBLAS call.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <memory>
#include <utility>
#include <vector>

#include "passes.h"
#include "tierzero/common/checks.h"

namespace tz::train::cuda {

// Loads libcublas and resolves the entry points this file's users call, once
// per process (cublas_stubs.cpp, Note [CUDA libraries load on first use]);
// Context::create calls it. The error names the paths tried.
Status load_cublas();

namespace detail_ {
Status cublas_error(cublasStatus_t status, const char* call, std::source_location where);
}  // namespace detail_

// cuBLAS's check macro (TZ_CUDA_CHECK's twin): a Status naming the call.
#define TZ_CUBLAS_CHECK(call)                                                                         \
  do {                                                                                                \
    cublasStatus_t tz_cublas_status_ = (call);                                                        \
    if (tz_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                                 \
      return ::tz::train::cuda::detail_::cublas_error(tz_cublas_status_, #call,                       \
                                                      std::source_location::current());               \
    }                                                                                                 \
  } while (0)

// n Ts of device memory (cudaMalloc). resize() allocates only when n exceeds
// the capacity, so a workspace that sees the same shapes again allocates nothing.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  ~DeviceArray() {
    if (d_ != nullptr) (void)cudaFree(d_);
  }
  DeviceArray(DeviceArray&& o) noexcept
      : d_(std::exchange(o.d_, nullptr)), size_(std::exchange(o.size_, 0)), capacity_(std::exchange(o.capacity_, 0)) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      if (d_ != nullptr) (void)cudaFree(d_);
      d_ = std::exchange(o.d_, nullptr);
      size_ = std::exchange(o.size_, 0);
      capacity_ = std::exchange(o.capacity_, 0);
    }
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* data() const { return d_; }
  std::size_t size() const { return size_; }
  std::size_t bytes() const { return size_ * sizeof(T); }

  // Makes the array n long; the contents are undefined after a reallocation.
  Status resize(std::size_t n) {
    if (n > capacity_) {
      if (d_ != nullptr) TZ_CUDA_CHECK(cudaFree(d_));
      d_ = nullptr;
      capacity_ = 0;
      void* p = nullptr;
      TZ_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
      d_ = static_cast<T*>(p);
      capacity_ = n;
    }
    size_ = n;
    return ok_status();
  }

 private:
  T* d_ = nullptr;
  std::size_t size_ = 0, capacity_ = 0;
};

struct ContextOptions {
  // cuBLAS may run the fp32 GEMMs on TF32 tensor cores
  // (CUBLAS_TF32_TENSOR_OP_MATH): 10-bit mantissas in the products, fp32
  // accumulation, several times the FP32 rate. Off: full fp32.
  bool tf32 = false;
};

// The compute stream and the cuBLAS handle bound to it. Move-only through unique_ptr.
class Context {
 public:
  static Expected<std::unique_ptr<Context>> create(const ContextOptions& options);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  cudaStream_t stream() const { return stream_; }
  cublasHandle_t blas() const { return blas_; }
  bool tf32() const { return tf32_; }
  // Waits for everything enqueued so far; surfaces asynchronous kernel errors.
  Status synchronize();

 private:
  Context() = default;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  bool tf32_ = false;
};

// What one transformer block saves in forward for its backward (passes.h's LayerActs).
struct LayerActs {
  DeviceArray<float> x_in;                          // (N, H) the block's input (residual stream)
  DeviceArray<float> ln1, ln1_mean, ln1_rstd;       // (N, H), (N), (N)
  DeviceArray<float> qkv;                           // (N, 3H)
  DeviceArray<float> q, k, v;                       // (B, heads, T, d) each, d = H / heads
  DeviceArray<float> probs;                         // (B, heads, T, T), zero above the diagonal
  DeviceArray<float> att;                           // (N, H) heads' outputs, before attn.proj
  DeviceArray<float> x_mid;                         // (N, H)
  DeviceArray<float> ln2, ln2_mean, ln2_rstd;       // (N, H), (N), (N)
  DeviceArray<float> fc, gelu;                      // (N, 4H) before and after GELU
};

// Every activation and scratch buffer of one micro-batch, in device memory.
struct Workspace {
  detail::Shape shape;
  std::vector<LayerActs> layers;
  DeviceArray<float> x_final;                       // (N, H) the last block's output
  DeviceArray<float> lnf, lnf_mean, lnf_rstd;       // (N, H), (N), (N)
  DeviceArray<float> logits, dlogits;               // (N, V)
  DeviceArray<float> row_loss;                      // (N,)
  DeviceArray<float> dx, d_mid, d_tmp, d_att;       // (N, H)
  DeviceArray<float> d_qkv;                         // (N, 3H)
  DeviceArray<float> d_ffn;                         // (N, 4H)
  DeviceArray<float> o, d_o, dq, dk, dv;            // (B, heads, T, d) scratch
  DeviceArray<float> d_probs;                       // (B, heads, T, T) scratch
  DeviceArray<std::int32_t> tokens, targets;        // (N,)
  std::vector<float> h_row_loss;                    // (N,) host copy of row_loss

  // Sized for shape s and `layers` blocks; allocates only when something grows.
  Status resize(const detail::Shape& s, int layers);
  // The residual stream entering block l (l == layers: the final one).
  float* stream(std::size_t l) { return l < layers.size() ? layers[l].x_in.data() : x_final.data(); }
};

// ws.tokens, ws.targets = the batch's (a synchronous copy from pageable memory).
Status upload_tokens(Context& ctx, const TokenBatch& batch, Workspace& ws);

// dst (n,) fp32 = src (n,) of `type` (device memory).
Status to_fp32(Context& ctx, const void* d_src, DType type, float* d_dst, std::size_t n);
// dst (n,) of `type` = src (n,) fp32, rounded to nearest even (device memory).
Status from_fp32(Context& ctx, const float* d_src, DType type, void* d_dst, std::size_t n);
// In place: x = fp32(round(x to `type`)).
Status round_through(Context& ctx, float* d_x, DType type, std::size_t n);

// passes.h's functions on device memory: w is the block's fp32 weights
// (used_numel), g its fp32 gradients (accumulated into).
Status embed_forward(Context& ctx, const detail::Shape& s, const BlockLayout& embed, const float* w,
                     const std::int32_t* d_tokens, float* x);
Status embed_backward(Context& ctx, const detail::Shape& s, const BlockLayout& embed, const std::int32_t* d_tokens,
                      const float* dx, float* g);
Status layer_forward(Context& ctx, const detail::Shape& s, const BlockLayout& block, const float* w, Workspace& ws,
                     std::size_t l);
Status layer_backward(Context& ctx, const detail::Shape& s, const BlockLayout& block, const float* w, Workspace& ws,
                      std::size_t l, float* g);
// Final LayerNorm, tied head and mean cross-entropy on ws.x_final against
// ws.targets; with g, also backward into ws.dx and g. Waits for the loss.
Expected<double> head(Context& ctx, const detail::Shape& s, const BlockLayout& embed, const float* w, double scale,
                      Workspace& ws, float* g);

}  // namespace tz::train::cuda
