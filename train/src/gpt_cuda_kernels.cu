// The CUDA GPT's kernels (gpt_cuda_kernels.h): simple and correct first.
// Element-wise work runs in grid-stride loops; row-wise work (LayerNorm,
// softmax, cross-entropy) gives each row one warp, which walks the row in
// lane-strided order and reduces with shuffles; sums over rows (bias and
// LayerNorm gradients) give each column one thread-column of a 32 x 8 block,
// reduced in a fixed order, so they are deterministic. Only the embedding's
// backward uses atomics (token rows repeat), as the CPU twin's comment allows.
// The formulas are ops.cpp's, in fp32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gpt_cuda_kernels.h"

namespace tz::train::cuda::launch {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr float kLayerNormEps = 1e-5F;    // ops.h's kLayerNormEps
constexpr float kGeluC = 0.7978845608028654F;  // sqrt(2 / pi), as ops.cpp
constexpr float kGeluA = 0.044715F;

unsigned grid_for(std::size_t n) {
  constexpr std::size_t kMaxBlocks = 65535 * 8;
  const std::size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks == 0 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks));
}
unsigned grid_for_rows(int rows) { return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

__device__ std::size_t global_index() { return blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; }
__device__ std::size_t global_stride() { return static_cast<std::size_t>(gridDim.x) * blockDim.x; }
// The row of the calling warp (one warp per row), and its lane.
__device__ int warp_row() { return static_cast<int>(blockIdx.x) * kWarpsPerBlock + static_cast<int>(threadIdx.x / 32); }
__device__ int lane() { return static_cast<int>(threadIdx.x % 32); }

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffU, v, o);
  return v;
}
__device__ float warp_max(float v) {
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffU, v, o));
  return v;
}

// ---------------------------------------------------------------- casts

__global__ void to_fp32_kernel(const void* src, int type, float* dst, std::size_t n) {
  for (std::size_t i = global_index(); i < n; i += global_stride()) {
    if (type == 1) {
      dst[i] = __bfloat162float(static_cast<const __nv_bfloat16*>(src)[i]);
    } else if (type == 2) {
      dst[i] = __half2float(static_cast<const __half*>(src)[i]);
    } else {
      dst[i] = static_cast<const float*>(src)[i];
    }
  }
}

__global__ void round_through_kernel(const float* src, int type, float* dst, std::size_t n) {
  for (std::size_t i = global_index(); i < n; i += global_stride()) {
    if (type == 1) {
      dst[i] = __bfloat162float(__float2bfloat16_rn(src[i]));
    } else if (type == 2) {
      dst[i] = __half2float(__float2half_rn(src[i]));
    } else {
      dst[i] = src[i];
    }
  }
}

// ---------------------------------------------------------------- embedding

__global__ void embedding_forward_kernel(const std::int32_t* tokens, const float* wte, const float* wpe, float* x,
                                         int seq, int dim, std::size_t n) {
  for (std::size_t i = global_index(); i < n; i += global_stride()) {
    const std::size_t r = i / dim, j = i % dim;
    x[i] = wte[static_cast<std::size_t>(tokens[r]) * dim + j] + wpe[(r % seq) * dim + j];
  }
}

__global__ void embedding_backward_kernel(const std::int32_t* tokens, const float* dx, float* dwte, float* dwpe,
                                          int seq, int dim, std::size_t n) {
  for (std::size_t i = global_index(); i < n; i += global_stride()) {
    const std::size_t r = i / dim, j = i % dim;
    atomicAdd(&dwte[static_cast<std::size_t>(tokens[r]) * dim + j], dx[i]);
    atomicAdd(&dwpe[(r % seq) * dim + j], dx[i]);
  }
}

// ---------------------------------------------------------------- LayerNorm

__global__ void layernorm_forward_kernel(const float* x, const float* g, const float* b, float* y, float* mean,
                                         float* rstd, int rows, int dim) {
  const int r = warp_row();
  if (r >= rows) return;
  const float* xr = x + static_cast<std::size_t>(r) * dim;
  float sum = 0;
  for (int j = lane(); j < dim; j += 32) sum += xr[j];
  const float mu = warp_sum(sum) / static_cast<float>(dim);
  float var = 0;
  for (int j = lane(); j < dim; j += 32) var += (xr[j] - mu) * (xr[j] - mu);
  const float rs = 1.0F / sqrtf(warp_sum(var) / static_cast<float>(dim) + kLayerNormEps);
  float* yr = y + static_cast<std::size_t>(r) * dim;
  for (int j = lane(); j < dim; j += 32) yr[j] = (xr[j] - mu) * rs * g[j] + b[j];
  if (lane() == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
}

__global__ void layernorm_backward_dx_kernel(const float* x, const float* g, const float* mean, const float* rstd,
                                             const float* dy, float* dx, int rows, int dim) {
  const int r = warp_row();
  if (r >= rows) return;
  const std::size_t off = static_cast<std::size_t>(r) * dim;
  float sum_dxhat = 0, sum_dxhat_xhat = 0;
  for (int j = lane(); j < dim; j += 32) {
    const float xhat = (x[off + j] - mean[r]) * rstd[r];
    const float dxhat = dy[off + j] * g[j];
    sum_dxhat += dxhat;
    sum_dxhat_xhat += dxhat * xhat;
  }
  const float a = warp_sum(sum_dxhat) / static_cast<float>(dim);
  const float c = warp_sum(sum_dxhat_xhat) / static_cast<float>(dim);
  for (int j = lane(); j < dim; j += 32) {
    const float xhat = (x[off + j] - mean[r]) * rstd[r];
    dx[off + j] = rstd[r] * (dy[off + j] * g[j] - a - xhat * c);
  }
}

// out[j] += sum over rows of f(r, j): block (32, 8) per 32 columns; thread
// (jx, ry) sums rows ry, ry + 8, ..., then the 8 partial sums are added in order.
template <typename F>
__global__ void column_sums_kernel(float* out, int rows, int cols, F f) {
  __shared__ float partial[8][33];
  const int j = static_cast<int>(blockIdx.x) * 32 + static_cast<int>(threadIdx.x);
  float s = 0;
  if (j < cols) {
    for (int r = static_cast<int>(threadIdx.y); r < rows; r += 8) s += f(r, j);
  }
  partial[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    float total = 0;
    for (int y = 0; y < 8; ++y) total += partial[y][threadIdx.x];
    out[j] += total;
  }
}

template <typename F>
cudaError_t column_sums(float* out, int rows, int cols, F f, cudaStream_t stream) {
  const dim3 block(32, 8);
  column_sums_kernel<<<static_cast<unsigned>((cols + 31) / 32), block, 0, stream>>>(out, rows, cols, f);
  return cudaGetLastError();
}

struct LnWeightGrad {
  const float *x, *mean, *rstd, *dy;
  int dim;
  __device__ float operator()(int r, int j) const {
    const std::size_t i = static_cast<std::size_t>(r) * dim + j;
    return dy[i] * ((x[i] - mean[r]) * rstd[r]);
  }
};

struct Column {
  const float* m;
  int cols;
  __device__ float operator()(int r, int j) const { return m[static_cast<std::size_t>(r) * cols + j]; }
};

// ---------------------------------------------------------------- element-wise

__global__ void add_bias_kernel(float* y, const float* b, int cols, std::size_t n) {
  for (std::size_t i = global_index(); i < n; i += global_stride()) y[i] += b[i % cols];
}

__global__ void add_kernel(const float* a, const float* b, float* out, std::size_t n) {
  for (std::size_t i = global_index(); i < n; i += global_stride()) out[i] = a[i] + b[i];
}

__global__ void gelu_forward_kernel(const float* x, float* y, std::size_t n) {
  for (std::size_t i = global_index(); i < n; i += global_stride()) {
    const float v = x[i];
    y[i] = 0.5F * v * (1 + tanhf(kGeluC * (v + kGeluA * v * v * v)));
  }
}

__global__ void gelu_backward_kernel(const float* x, const float* dy, float* dx, std::size_t n) {
  for (std::size_t i = global_index(); i < n; i += global_stride()) {
    const float v = x[i];
    const float t = tanhf(kGeluC * (v + kGeluA * v * v * v));
    const float dt = (1 - t * t) * kGeluC * (1 + 3 * kGeluA * v * v);
    dx[i] = dy[i] * (0.5F * (1 + t) + 0.5F * v * dt);
  }
}

// ---------------------------------------------------------------- attention layout

// Element i of (B*T, parts*H) <-> element of part p in (B, heads, T, d).
struct HeadIndex {
  int part;
  std::size_t head_major;
};
__device__ HeadIndex head_index(std::size_t i, int parts, int seq, int heads, int dim) {
  const std::size_t width = static_cast<std::size_t>(parts) * dim;
  const std::size_t row = i / width;
  const int col = static_cast<int>(i % width);
  const int part = col / dim, within = col % dim;
  const int d = dim / heads;
  const int head = within / d, j = within % d;
  const std::size_t b = row / seq, t = row % seq;
  return {part, ((b * heads + head) * seq + t) * d + j};
}

__global__ void split_heads_kernel(const float* qkv, float* q, float* k, float* v, int seq, int heads, int dim,
                                   std::size_t n) {
  for (std::size_t i = global_index(); i < n; i += global_stride()) {
    const HeadIndex h = head_index(i, 3, seq, heads, dim);
    float* dst = h.part == 0 ? q : h.part == 1 ? k : v;
    dst[h.head_major] = qkv[i];
  }
}

__global__ void merge_qkv_kernel(const float* dq, const float* dk, const float* dv, float* dqkv, int seq, int heads,
                                 int dim, std::size_t n) {
  for (std::size_t i = global_index(); i < n; i += global_stride()) {
    const HeadIndex h = head_index(i, 3, seq, heads, dim);
    const float* src = h.part == 0 ? dq : h.part == 1 ? dk : dv;
    dqkv[i] = src[h.head_major];
  }
}

__global__ void merge_heads_kernel(const float* o, float* out, int seq, int heads, int dim, std::size_t n) {
  for (std::size_t i = global_index(); i < n; i += global_stride()) out[i] = o[head_index(i, 1, seq, heads, dim).head_major];
}

__global__ void split_out_kernel(const float* out, float* o, int seq, int heads, int dim, std::size_t n) {
  for (std::size_t i = global_index(); i < n; i += global_stride()) o[head_index(i, 1, seq, heads, dim).head_major] = out[i];
}

// ---------------------------------------------------------------- causal softmax

__global__ void causal_softmax_forward_kernel(float* s, int rows, int seq, float scale) {
  const int r = warp_row();
  if (r >= rows) return;
  const int i = r % seq;  // the query position: keys 0..i are visible
  float* row = s + static_cast<std::size_t>(r) * seq;
  float mx = -INFINITY;
  for (int j = lane(); j <= i; j += 32) mx = fmaxf(mx, row[j] * scale);
  mx = warp_max(mx);
  float sum = 0;
  for (int j = lane(); j <= i; j += 32) {
    row[j] = expf(row[j] * scale - mx);
    sum += row[j];
  }
  const float total = warp_sum(sum);
  for (int j = lane(); j < seq; j += 32) row[j] = j <= i ? row[j] / total : 0.0F;
}

__global__ void causal_softmax_backward_kernel(const float* p, float* dp, int rows, int seq, float scale) {
  const int r = warp_row();
  if (r >= rows) return;
  const int i = r % seq;
  const float* pr = p + static_cast<std::size_t>(r) * seq;
  float* dr = dp + static_cast<std::size_t>(r) * seq;
  float dot = 0;
  for (int j = lane(); j <= i; j += 32) dot += pr[j] * dr[j];
  dot = warp_sum(dot);
  for (int j = lane(); j < seq; j += 32) dr[j] = j <= i ? pr[j] * (dr[j] - dot) * scale : 0.0F;
}

// ---------------------------------------------------------------- cross-entropy

__global__ void cross_entropy_kernel(const float* logits, const std::int32_t* targets, float* row_loss,
                                     float* dlogits, int rows, int vocab, float grad_scale) {
  const int r = warp_row();
  if (r >= rows) return;
  const float* lr = logits + static_cast<std::size_t>(r) * vocab;
  float mx = -INFINITY;
  for (int j = lane(); j < vocab; j += 32) mx = fmaxf(mx, lr[j]);
  mx = warp_max(mx);
  float sum = 0;
  for (int j = lane(); j < vocab; j += 32) sum += expf(lr[j] - mx);
  const float log_sum = logf(warp_sum(sum));
  const int target = targets[r];
  if (lane() == 0) row_loss[r] = log_sum + mx - lr[target];
  if (dlogits == nullptr) return;
  float* dr = dlogits + static_cast<std::size_t>(r) * vocab;
  for (int j = lane(); j < vocab; j += 32) {
    dr[j] = expf(lr[j] - mx - log_sum) * grad_scale - (j == target ? grad_scale : 0.0F);
  }
}

}  // namespace

cudaError_t to_fp32(const void* src, int src_type, float* dst, std::size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  to_fp32_kernel<<<grid_for(n), kThreads, 0, stream>>>(src, src_type, dst, n);
  return cudaGetLastError();
}

cudaError_t round_through(const float* src, int type, float* dst, std::size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  round_through_kernel<<<grid_for(n), kThreads, 0, stream>>>(src, type, dst, n);
  return cudaGetLastError();
}

cudaError_t embedding_forward(const std::int32_t* tokens, const float* wte, const float* wpe, float* x, int batch,
                              int seq, int dim, cudaStream_t stream) {
  const std::size_t n = static_cast<std::size_t>(batch) * seq * dim;
  embedding_forward_kernel<<<grid_for(n), kThreads, 0, stream>>>(tokens, wte, wpe, x, seq, dim, n);
  return cudaGetLastError();
}

cudaError_t embedding_backward(const std::int32_t* tokens, const float* dx, float* dwte, float* dwpe, int batch,
                               int seq, int dim, cudaStream_t stream) {
  const std::size_t n = static_cast<std::size_t>(batch) * seq * dim;
  embedding_backward_kernel<<<grid_for(n), kThreads, 0, stream>>>(tokens, dx, dwte, dwpe, seq, dim, n);
  return cudaGetLastError();
}

cudaError_t layernorm_forward(const float* x, const float* g, const float* b, float* y, float* mean, float* rstd,
                              int rows, int dim, cudaStream_t stream) {
  layernorm_forward_kernel<<<grid_for_rows(rows), kThreads, 0, stream>>>(x, g, b, y, mean, rstd, rows, dim);
  return cudaGetLastError();
}

cudaError_t layernorm_backward(const float* x, const float* g, const float* mean, const float* rstd, const float* dy,
                               float* dx, float* dg, float* db, int rows, int dim, cudaStream_t stream) {
  layernorm_backward_dx_kernel<<<grid_for_rows(rows), kThreads, 0, stream>>>(x, g, mean, rstd, dy, dx, rows, dim);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (cudaError_t e = column_sums(dg, rows, dim, LnWeightGrad{x, mean, rstd, dy, dim}, stream); e != cudaSuccess) {
    return e;
  }
  return column_sums(db, rows, dim, Column{dy, dim}, stream);
}

cudaError_t add_bias(float* y, const float* b, int rows, int cols, cudaStream_t stream) {
  const std::size_t n = static_cast<std::size_t>(rows) * cols;
  add_bias_kernel<<<grid_for(n), kThreads, 0, stream>>>(y, b, cols, n);
  return cudaGetLastError();
}

cudaError_t bias_grad(const float* dy, float* db, int rows, int cols, cudaStream_t stream) {
  return column_sums(db, rows, cols, Column{dy, cols}, stream);
}

cudaError_t add(const float* a, const float* b, float* out, std::size_t n, cudaStream_t stream) {
  add_kernel<<<grid_for(n), kThreads, 0, stream>>>(a, b, out, n);
  return cudaGetLastError();
}

cudaError_t gelu_forward(const float* x, float* y, std::size_t n, cudaStream_t stream) {
  gelu_forward_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, y, n);
  return cudaGetLastError();
}

cudaError_t gelu_backward(const float* x, const float* dy, float* dx, std::size_t n, cudaStream_t stream) {
  gelu_backward_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, dy, dx, n);
  return cudaGetLastError();
}

cudaError_t split_heads(const float* qkv, float* q, float* k, float* v, int batch, int seq, int heads, int dim,
                        cudaStream_t stream) {
  const std::size_t n = static_cast<std::size_t>(batch) * seq * 3 * dim;
  split_heads_kernel<<<grid_for(n), kThreads, 0, stream>>>(qkv, q, k, v, seq, heads, dim, n);
  return cudaGetLastError();
}

cudaError_t merge_qkv(const float* dq, const float* dk, const float* dv, float* dqkv, int batch, int seq, int heads,
                      int dim, cudaStream_t stream) {
  const std::size_t n = static_cast<std::size_t>(batch) * seq * 3 * dim;
  merge_qkv_kernel<<<grid_for(n), kThreads, 0, stream>>>(dq, dk, dv, dqkv, seq, heads, dim, n);
  return cudaGetLastError();
}

cudaError_t merge_heads(const float* o, float* out, int batch, int seq, int heads, int dim, cudaStream_t stream) {
  const std::size_t n = static_cast<std::size_t>(batch) * seq * dim;
  merge_heads_kernel<<<grid_for(n), kThreads, 0, stream>>>(o, out, seq, heads, dim, n);
  return cudaGetLastError();
}

cudaError_t split_out(const float* out, float* o, int batch, int seq, int heads, int dim, cudaStream_t stream) {
  const std::size_t n = static_cast<std::size_t>(batch) * seq * dim;
  split_out_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, o, seq, heads, dim, n);
  return cudaGetLastError();
}

cudaError_t causal_softmax_forward(float* s, int count, int seq, float scale, cudaStream_t stream) {
  const int rows = count * seq;
  causal_softmax_forward_kernel<<<grid_for_rows(rows), kThreads, 0, stream>>>(s, rows, seq, scale);
  return cudaGetLastError();
}

cudaError_t causal_softmax_backward(const float* p, float* dp, int count, int seq, float scale, cudaStream_t stream) {
  const int rows = count * seq;
  causal_softmax_backward_kernel<<<grid_for_rows(rows), kThreads, 0, stream>>>(p, dp, rows, seq, scale);
  return cudaGetLastError();
}

cudaError_t cross_entropy(const float* logits, const std::int32_t* targets, float* row_loss, float* dlogits,
                          int rows, int vocab, float grad_scale, cudaStream_t stream) {
  cross_entropy_kernel<<<grid_for_rows(rows), kThreads, 0, stream>>>(logits, targets, row_loss, dlogits, rows, vocab,
                                                                     grad_scale);
  return cudaGetLastError();
}

}  // namespace tz::train::cuda::launch
