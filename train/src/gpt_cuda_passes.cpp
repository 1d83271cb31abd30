// The GPT's pieces on CUDA (gpt_cuda.h): passes.cpp's order and formulas,
// with cuBLAS for the products and gpt_cuda_kernels.cu for the rest.
#include <cuda_runtime.h>

#include <cmath>

#include "gpt_cuda.h"
#include "gpt_cuda_kernels.h"
#include "tierzero/kernels.h"

namespace tz::train::cuda {

namespace detail_ {
Status cublas_error(cublasStatus_t status, const char* call, std::source_location where) {
  (void)cudaGetLastError();
  const ErrorCode code = status == CUBLAS_STATUS_ALLOC_FAILED      ? ErrorCode::kOutOfMemory
                         : status == CUBLAS_STATUS_NOT_INITIALIZED ? ErrorCode::kUnavailable
                                                                   : ErrorCode::kInternal;
  return Status(code, fmt::format("{}: {} ({}, cuBLAS status {})", call, cublasGetStatusString(status),
                                  cublasGetStatusName(status), static_cast<int>(status)))
      .add_frame(where);
}
}  // namespace detail_

namespace {

using detail::param;
using detail::Shape;

int type_code(DType t) { return t == DType::kBf16 ? 1 : t == DType::kFp16 ? 2 : 0; }

// Row-major c (m, n) = alpha op(a) op(b) + beta c, op(a) (m, k): a stored (m, k),
// or (k, m) when ta; op(b) (k, n): b stored (k, n), or (n, k) when tb (ops.h's
// matmul). cuBLAS is column-major, where a row-major (r, c) matrix reads as
// its transpose, so it computes c^T = op(b)^T op(a)^T.
Status gemm(Context& ctx, const float* a, bool ta, const float* b, bool tb, float* c, int m, int n, int k, float beta) {
  const float alpha = 1.0F;
  TZ_CUBLAS_CHECK(cublasSgemm(ctx.blas(), tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k,
                              &alpha, b, tb ? k : n, a, ta ? m : k, &beta, c, n));
  return ok_status();
}

// `count` independent gemms, matrix i at a + i stride_a etc.
Status gemm_batched(Context& ctx, const float* a, bool ta, long long stride_a, const float* b, bool tb,
                    long long stride_b, float* c, long long stride_c, int m, int n, int k, int count) {
  const float alpha = 1.0F, beta = 0.0F;
  TZ_CUBLAS_CHECK(cublasSgemmStridedBatched(ctx.blas(), tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                            n, m, k, &alpha, b, tb ? k : n, stride_b, a, ta ? m : k, stride_a, &beta,
                                            c, n, stride_c, count));
  return ok_status();
}

// ops.h's linear_forward: y (rows, out) = x (rows, in) w^T + b (b may be null).
Status linear_forward(Context& ctx, const float* x, const float* w, const float* b, float* y, int rows, int in,
                      int out) {
  TZ_TRY(gemm(ctx, x, false, w, true, y, rows, out, in, 0.0F));
  if (b != nullptr) TZ_CUDA_CHECK(launch::add_bias(y, b, rows, out, ctx.stream()));
  return ok_status();
}

// ops.h's linear_backward: dx = dy w (when dx), dw += dy^T x, db += colsum(dy) (when db).
Status linear_backward(Context& ctx, const float* x, const float* w, const float* dy, float* dx, float* dw, float* db,
                       int rows, int in, int out) {
  if (dx != nullptr) TZ_TRY(gemm(ctx, dy, false, w, false, dx, rows, in, out, 0.0F));
  TZ_TRY(gemm(ctx, dy, true, x, false, dw, out, in, rows, 1.0F));
  if (db != nullptr) TZ_CUDA_CHECK(launch::bias_grad(dy, db, rows, out, ctx.stream()));
  return ok_status();
}

struct AttnDims {
  int batch, seq, heads, dim, head_dim, count;  // count = batch * heads
  long long td, tt;                              // per-head strides: T d and T T
};
AttnDims attn_dims(const Shape& s) {
  const int d = s.hidden / s.heads;
  return {s.batch, s.seq, s.heads, s.hidden, d, s.batch * s.heads, static_cast<long long>(s.seq) * d,
          static_cast<long long>(s.seq) * s.seq};
}
float attn_scale(const AttnDims& a) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(a.head_dim))); }

// attention.cpp's forward: S = q k^T, P = causal softmax(S / sqrt(d)), O = P v.
Status attention_forward(Context& ctx, const Shape& s, LayerActs& a, Workspace& ws) {
  const AttnDims d = attn_dims(s);
  cudaStream_t st = ctx.stream();
  TZ_CUDA_CHECK(launch::split_heads(a.qkv.data(), a.q.data(), a.k.data(), a.v.data(), d.batch, d.seq, d.heads, d.dim, st));
  TZ_TRY(gemm_batched(ctx, a.q.data(), false, d.td, a.k.data(), true, d.td, a.probs.data(), d.tt, d.seq, d.seq,
                      d.head_dim, d.count));
  TZ_CUDA_CHECK(launch::causal_softmax_forward(a.probs.data(), d.count, d.seq, attn_scale(d), st));
  TZ_TRY(gemm_batched(ctx, a.probs.data(), false, d.tt, a.v.data(), false, d.td, ws.o.data(), d.td, d.seq,
                      d.head_dim, d.seq, d.count));
  TZ_CUDA_CHECK(launch::merge_heads(ws.o.data(), a.att.data(), d.batch, d.seq, d.heads, d.dim, st));
  return ok_status();
}

// attention.cpp's backward: dP = dO v^T, dV = P^T dO, dS = P (dP - rowsum(P dP)) / sqrt(d),
// dQ = dS k, dK = dS^T q; from ws.d_att into ws.d_qkv.
Status attention_backward(Context& ctx, const Shape& s, const LayerActs& a, Workspace& ws) {
  const AttnDims d = attn_dims(s);
  cudaStream_t st = ctx.stream();
  TZ_CUDA_CHECK(launch::split_out(ws.d_att.data(), ws.d_o.data(), d.batch, d.seq, d.heads, d.dim, st));
  TZ_TRY(gemm_batched(ctx, ws.d_o.data(), false, d.td, a.v.data(), true, d.td, ws.d_probs.data(), d.tt, d.seq, d.seq,
                      d.head_dim, d.count));
  TZ_TRY(gemm_batched(ctx, a.probs.data(), true, d.tt, ws.d_o.data(), false, d.td, ws.dv.data(), d.td, d.seq,
                      d.head_dim, d.seq, d.count));
  TZ_CUDA_CHECK(launch::causal_softmax_backward(a.probs.data(), ws.d_probs.data(), d.count, d.seq, attn_scale(d), st));
  TZ_TRY(gemm_batched(ctx, ws.d_probs.data(), false, d.tt, a.k.data(), false, d.td, ws.dq.data(), d.td, d.seq,
                      d.head_dim, d.seq, d.count));
  TZ_TRY(gemm_batched(ctx, ws.d_probs.data(), true, d.tt, a.q.data(), false, d.td, ws.dk.data(), d.td, d.seq,
                      d.head_dim, d.seq, d.count));
  TZ_CUDA_CHECK(launch::merge_qkv(ws.dq.data(), ws.dk.data(), ws.dv.data(), ws.d_qkv.data(), d.batch, d.seq, d.heads,
                                  d.dim, st));
  return ok_status();
}

}  // namespace

// ---------------------------------------------------------------- Context

Expected<std::unique_ptr<Context>> Context::create(const ContextOptions& options) {
  TZ_TRY(load_cublas());  // Note [CUDA libraries load on first use]
  std::unique_ptr<Context> ctx(new Context());
  ctx->tf32_ = options.tf32;
  TZ_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx->stream_, cudaStreamNonBlocking));
  TZ_CUBLAS_CHECK(cublasCreate(&ctx->blas_));
  TZ_CUBLAS_CHECK(cublasSetStream(ctx->blas_, ctx->stream_));
  TZ_CUBLAS_CHECK(cublasSetMathMode(ctx->blas_, options.tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  return ctx;
}

Context::~Context() {
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
  if (blas_ != nullptr) (void)cublasDestroy(blas_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

Status Context::synchronize() {
  TZ_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return ok_status();
}

// ---------------------------------------------------------------- Workspace

Status Workspace::resize(const Shape& s, int num_layers) {
  shape = s;
  const std::size_t n = s.rows(), h = static_cast<std::size_t>(s.hidden);
  const std::size_t probs = static_cast<std::size_t>(s.batch) * s.heads * s.seq * s.seq;
  if (layers.size() != static_cast<std::size_t>(num_layers)) layers.resize(static_cast<std::size_t>(num_layers));
  for (LayerActs& a : layers) {
    for (auto* v : {&a.x_in, &a.ln1, &a.q, &a.k, &a.v, &a.att, &a.x_mid, &a.ln2}) TZ_TRY(v->resize(n * h));
    for (auto* v : {&a.ln1_mean, &a.ln1_rstd, &a.ln2_mean, &a.ln2_rstd}) TZ_TRY(v->resize(n));
    TZ_TRY(a.qkv.resize(n * 3 * h));
    TZ_TRY(a.probs.resize(probs));
    TZ_TRY(a.fc.resize(n * 4 * h));
    TZ_TRY(a.gelu.resize(n * 4 * h));
  }
  for (auto* v : {&x_final, &lnf, &dx, &d_mid, &d_tmp, &d_att, &o, &d_o, &dq, &dk, &dv}) TZ_TRY(v->resize(n * h));
  for (auto* v : {&lnf_mean, &lnf_rstd, &row_loss}) TZ_TRY(v->resize(n));
  TZ_TRY(logits.resize(n * s.vocab));
  TZ_TRY(dlogits.resize(n * s.vocab));
  TZ_TRY(d_qkv.resize(n * 3 * h));
  TZ_TRY(d_ffn.resize(n * 4 * h));
  TZ_TRY(d_probs.resize(probs));
  TZ_TRY(tokens.resize(n));
  TZ_TRY(targets.resize(n));
  h_row_loss.resize(n);
  return ok_status();
}

Status upload_tokens(Context& ctx, const TokenBatch& batch, Workspace& ws) {
  const std::size_t n = batch.inputs.size();
  TZ_CUDA_CHECK(cudaMemcpyAsync(ws.tokens.data(), batch.inputs.data(), n * sizeof(std::int32_t), cudaMemcpyHostToDevice,
                                ctx.stream()));
  TZ_CUDA_CHECK(cudaMemcpyAsync(ws.targets.data(), batch.targets.data(), n * sizeof(std::int32_t),
                                cudaMemcpyHostToDevice, ctx.stream()));
  // The batch's vectors are pageable and may change after we return.
  return ctx.synchronize();
}

// ---------------------------------------------------------------- casts

Status to_fp32(Context& ctx, const void* d_src, DType type, float* d_dst, std::size_t n) {
  TZ_CUDA_CHECK(launch::to_fp32(d_src, type_code(type), d_dst, n, ctx.stream()));
  return ok_status();
}

Status from_fp32(Context& ctx, const float* d_src, DType type, void* d_dst, std::size_t n) {
  switch (type) {
    case DType::kFp32:
      TZ_CUDA_CHECK(cudaMemcpyAsync(d_dst, d_src, n * sizeof(float), cudaMemcpyDeviceToDevice, ctx.stream()));
      break;
    case DType::kBf16:
      TZ_TRY(kernels::cast_fp32_to_bf16_cuda(d_src, static_cast<std::uint16_t*>(d_dst), n, ctx.stream()));
      break;
    case DType::kFp16:
      TZ_TRY(kernels::cast_fp32_to_fp16_cuda(d_src, static_cast<std::uint16_t*>(d_dst), n, ctx.stream()));
      break;
    default: return invalid_argument("from_fp32: no cast to {}", dtype_name(type));
  }
  return ok_status();
}

Status round_through(Context& ctx, float* d_x, DType type, std::size_t n) {
  TZ_CUDA_CHECK(launch::round_through(d_x, type_code(type), d_x, n, ctx.stream()));
  return ok_status();
}

// ---------------------------------------------------------------- passes

Status embed_forward(Context& ctx, const Shape& s, const BlockLayout& embed, const float* w,
                     const std::int32_t* d_tokens, float* x) {
  TZ_CUDA_CHECK(launch::embedding_forward(d_tokens, param(w, embed, kWte), param(w, embed, kWpe), x, s.batch, s.seq,
                                          s.hidden, ctx.stream()));
  return ok_status();
}

Status embed_backward(Context& ctx, const Shape& s, const BlockLayout& embed, const std::int32_t* d_tokens,
                      const float* dx, float* g) {
  TZ_CUDA_CHECK(launch::embedding_backward(d_tokens, dx, param(g, embed, kWte), param(g, embed, kWpe), s.batch, s.seq,
                                           s.hidden, ctx.stream()));
  return ok_status();
}

Status layer_forward(Context& ctx, const Shape& s, const BlockLayout& block, const float* w, Workspace& ws,
                     std::size_t l) {
  LayerActs& a = ws.layers[l];
  const int n = static_cast<int>(s.rows()), h = s.hidden;
  const std::size_t nh = s.rows() * h;
  cudaStream_t st = ctx.stream();
  auto p = [&](std::size_t i) { return param(w, block, i); };
  TZ_CUDA_CHECK(launch::layernorm_forward(a.x_in.data(), p(kLn1W), p(kLn1B), a.ln1.data(), a.ln1_mean.data(),
                                          a.ln1_rstd.data(), n, h, st));
  TZ_TRY(linear_forward(ctx, a.ln1.data(), p(kQkvW), p(kQkvB), a.qkv.data(), n, h, 3 * h));
  TZ_TRY(attention_forward(ctx, s, a, ws));
  TZ_TRY(linear_forward(ctx, a.att.data(), p(kProjW), p(kProjB), a.x_mid.data(), n, h, h));
  TZ_CUDA_CHECK(launch::add(a.x_mid.data(), a.x_in.data(), a.x_mid.data(), nh, st));
  TZ_CUDA_CHECK(launch::layernorm_forward(a.x_mid.data(), p(kLn2W), p(kLn2B), a.ln2.data(), a.ln2_mean.data(),
                                          a.ln2_rstd.data(), n, h, st));
  TZ_TRY(linear_forward(ctx, a.ln2.data(), p(kFcW), p(kFcB), a.fc.data(), n, h, 4 * h));
  TZ_CUDA_CHECK(launch::gelu_forward(a.fc.data(), a.gelu.data(), nh * 4, st));
  float* out = ws.stream(l + 1);
  TZ_TRY(linear_forward(ctx, a.gelu.data(), p(kFc2W), p(kFc2B), out, n, 4 * h, h));
  TZ_CUDA_CHECK(launch::add(out, a.x_mid.data(), out, nh, st));
  return ok_status();
}

Status layer_backward(Context& ctx, const Shape& s, const BlockLayout& block, const float* w, Workspace& ws,
                      std::size_t l, float* g) {
  const LayerActs& a = ws.layers[l];
  const int n = static_cast<int>(s.rows()), h = s.hidden;
  const std::size_t nh = s.rows() * h;
  cudaStream_t st = ctx.stream();
  auto p = [&](std::size_t i) { return param(w, block, i); };
  auto d = [&](std::size_t i) { return param(g, block, i); };
  // MLP: out = x_mid + fc2(gelu(fc(ln2(x_mid)))).
  TZ_TRY(linear_backward(ctx, a.gelu.data(), p(kFc2W), ws.dx.data(), ws.d_ffn.data(), d(kFc2W), d(kFc2B), n, 4 * h, h));
  TZ_CUDA_CHECK(launch::gelu_backward(a.fc.data(), ws.d_ffn.data(), ws.d_ffn.data(), nh * 4, st));
  TZ_TRY(linear_backward(ctx, a.ln2.data(), p(kFcW), ws.d_ffn.data(), ws.d_tmp.data(), d(kFcW), d(kFcB), n, h, 4 * h));
  TZ_CUDA_CHECK(launch::layernorm_backward(a.x_mid.data(), p(kLn2W), a.ln2_mean.data(), a.ln2_rstd.data(),
                                           ws.d_tmp.data(), ws.d_att.data(), d(kLn2W), d(kLn2B), n, h, st));
  TZ_CUDA_CHECK(launch::add(ws.dx.data(), ws.d_att.data(), ws.d_mid.data(), nh, st));
  // Attention: x_mid = x_in + proj(attention(qkv(ln1(x_in)))).
  TZ_TRY(linear_backward(ctx, a.att.data(), p(kProjW), ws.d_mid.data(), ws.d_att.data(), d(kProjW), d(kProjB), n, h, h));
  TZ_TRY(attention_backward(ctx, s, a, ws));
  TZ_TRY(linear_backward(ctx, a.ln1.data(), p(kQkvW), ws.d_qkv.data(), ws.d_tmp.data(), d(kQkvW), d(kQkvB), n, h, 3 * h));
  TZ_CUDA_CHECK(launch::layernorm_backward(a.x_in.data(), p(kLn1W), a.ln1_mean.data(), a.ln1_rstd.data(),
                                           ws.d_tmp.data(), ws.d_att.data(), d(kLn1W), d(kLn1B), n, h, st));
  TZ_CUDA_CHECK(launch::add(ws.d_mid.data(), ws.d_att.data(), ws.dx.data(), nh, st));
  return ok_status();
}

Expected<double> head(Context& ctx, const Shape& s, const BlockLayout& embed, const float* w, double scale,
                      Workspace& ws, float* g) {
  const int n = static_cast<int>(s.rows()), h = s.hidden;
  cudaStream_t st = ctx.stream();
  TZ_CUDA_CHECK(launch::layernorm_forward(ws.x_final.data(), param(w, embed, kLnfW), param(w, embed, kLnfB),
                                          ws.lnf.data(), ws.lnf_mean.data(), ws.lnf_rstd.data(), n, h, st));
  // The tied head: logits = lnf wte^T.
  TZ_TRY(linear_forward(ctx, ws.lnf.data(), param(w, embed, kWte), nullptr, ws.logits.data(), n, h, s.vocab));
  const auto grad_scale = static_cast<float>(scale / n);
  TZ_CUDA_CHECK(launch::cross_entropy(ws.logits.data(), ws.targets.data(), ws.row_loss.data(),
                                      g != nullptr ? ws.dlogits.data() : nullptr, n, s.vocab, grad_scale, st));
  if (g != nullptr) {
    TZ_TRY(linear_backward(ctx, ws.lnf.data(), param(w, embed, kWte), ws.dlogits.data(), ws.d_tmp.data(),
                           param(g, embed, kWte), nullptr, n, h, s.vocab));
    TZ_CUDA_CHECK(launch::layernorm_backward(ws.x_final.data(), param(w, embed, kLnfW), ws.lnf_mean.data(),
                                             ws.lnf_rstd.data(), ws.d_tmp.data(), ws.dx.data(), param(g, embed, kLnfW),
                                             param(g, embed, kLnfB), n, h, st));
  }
  TZ_CUDA_CHECK(cudaMemcpyAsync(ws.h_row_loss.data(), ws.row_loss.data(), static_cast<std::size_t>(n) * sizeof(float),
                                cudaMemcpyDeviceToHost, st));
  TZ_TRY_CTX(ctx.synchronize(), "waiting for the loss");
  double total = 0;  // in row order, as ops.cpp's cross_entropy
  for (int r = 0; r < n; ++r) total += static_cast<double>(ws.h_row_loss[static_cast<std::size_t>(r)]);
  return total / n;
}

}  // namespace tz::train::cuda
