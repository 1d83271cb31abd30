// Private to train/: the launchers of the CUDA GPT's kernels (gpt_cuda_kernels.cu).
// They return cudaError_t (the launch's cudaGetLastError) and include nothing
// of tierzero's, because nvcc's host pass cannot compile fmt (and so Status);
// gpt_cuda_passes.cpp wraps them with TZ_CUDA_CHECK. Every launcher is
// asynchronous on `stream`; pointers are device memory; shapes are row-major
// (rows, cols) as in tierzero/train/ops.h, whose CPU operators these mirror.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tz::train::cuda::launch {

// dst (n,) fp32 = src (n,) in `src_type`: 0 fp32, 1 bf16, 2 fp16 (tz::DType's order).
cudaError_t to_fp32(const void* src, int src_type, float* dst, std::size_t n, cudaStream_t stream);
// dst (n,) fp32 = round(src to src_type) as fp32: what a 16-bit copy of src would hold.
cudaError_t round_through(const float* src, int type, float* dst, std::size_t n, cudaStream_t stream);

// x (B*T, H) = wte[tokens] + wpe[t].
cudaError_t embedding_forward(const std::int32_t* tokens, const float* wte, const float* wpe, float* x, int batch,
                              int seq, int dim, cudaStream_t stream);
// dwte[tokens[r]] += dx[r], dwpe[r % seq] += dx[r] (atomics).
cudaError_t embedding_backward(const std::int32_t* tokens, const float* dx, float* dwte, float* dwpe, int batch,
                               int seq, int dim, cudaStream_t stream);

// ops.h's layernorm_forward / layernorm_backward (dx overwritten, dg and db accumulated).
cudaError_t layernorm_forward(const float* x, const float* g, const float* b, float* y, float* mean, float* rstd,
                              int rows, int dim, cudaStream_t stream);
cudaError_t layernorm_backward(const float* x, const float* g, const float* mean, const float* rstd, const float* dy,
                               float* dx, float* dg, float* db, int rows, int dim, cudaStream_t stream);

// y (rows, cols) += b (cols,) on every row.
cudaError_t add_bias(float* y, const float* b, int rows, int cols, cudaStream_t stream);
// db (cols,) += the column sums of dy (rows, cols), rows in a fixed order.
cudaError_t bias_grad(const float* dy, float* db, int rows, int cols, cudaStream_t stream);
// out = a + b, element-wise; out may alias a or b.
cudaError_t add(const float* a, const float* b, float* out, std::size_t n, cudaStream_t stream);

// ops.h's GELU (tanh approximation); backward may run in place (dx == dy).
cudaError_t gelu_forward(const float* x, float* y, std::size_t n, cudaStream_t stream);
cudaError_t gelu_backward(const float* x, const float* dy, float* dx, std::size_t n, cudaStream_t stream);

// qkv (B*T, 3H) -> q, k, v (B, heads, T, H/heads) each.
cudaError_t split_heads(const float* qkv, float* q, float* k, float* v, int batch, int seq, int heads, int dim,
                        cudaStream_t stream);
// The reverse: dqkv (B*T, 3H) from dq, dk, dv (B, heads, T, H/heads).
cudaError_t merge_qkv(const float* dq, const float* dk, const float* dv, float* dqkv, int batch, int seq, int heads,
                      int dim, cudaStream_t stream);
// o (B, heads, T, d) <-> out (B*T, H), heads side by side.
cudaError_t merge_heads(const float* o, float* out, int batch, int seq, int heads, int dim, cudaStream_t stream);
cudaError_t split_out(const float* out, float* o, int batch, int seq, int heads, int dim, cudaStream_t stream);

// In place on s (count, T, T) of raw scores q k^T: P = softmax over j <= i of
// s * scale, 0 above the diagonal.
cudaError_t causal_softmax_forward(float* s, int count, int seq, float scale, cudaStream_t stream);
// In place on dp (count, T, T): dS = P * (dP - rowsum(P * dP)) * scale, 0 above the diagonal.
cudaError_t causal_softmax_backward(const float* p, float* dp, int count, int seq, float scale, cudaStream_t stream);

// Cross-entropy per row of logits (rows, vocab): row_loss (rows,) fp32; with
// dlogits non-null, dlogits = (softmax - onehot(target)) * grad_scale.
cudaError_t cross_entropy(const float* logits, const std::int32_t* targets, float* row_loss, float* dlogits,
                          int rows, int vocab, float grad_scale, cudaStream_t stream);

}  // namespace tz::train::cuda::launch
