// The CPU operators of the GPT workload (tierzero/train/gpt.h), forward and
// backward, written by hand.
//
// Every tensor is row-major and contiguous; shapes are in the comments as
// (rows, columns). Each operator is a template over the arithmetic type and
// is compiled for float (what training runs) and double (what the
// finite-difference tests check against). Work is spread over the cores with
// oneTBB; every reduction runs in a fixed order whatever the thread count, so
// a result depends only on the inputs (Note [Deterministic reductions] in
// ops.cpp), and the engine-driven model and its in-memory reference agree bit
// for bit given the same weights.
//
// Backward functions overwrite the input gradient (dx) and accumulate into
// parameter gradients (dw, db, dg), so a caller zeroes those once per pass.
// Pointers to different arguments must not overlap unless a function says so.
//
//   tz::train::linear_forward(x, w, b, y, rows, in, out);          // y = x w^T + b
//   tz::train::linear_backward(x, w, dy, dx, dw, db, rows, in, out);
//
// The arithmetic cannot fail: shapes are checked where they come from
// (tz::train::GptConfig::validate, the batch checks in gpt.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tz::train {

enum class Trans : bool { kNo = false, kYes = true };

// c (m, n) = op(a) op(b), or c += op(a) op(b) when `accumulate`.
// op(a) is (m, k): `a` is stored (m, k), or (k, m) with Trans::kYes; op(b) is
// (k, n): `b` is stored (k, n), or (n, k) with Trans::kYes. Each element of c
// sums over k in ascending order. float runs a register-tiled kernel (AVX2/FMA
// where the CPU has it, picked at run time); double a plain loop.
template <typename T>
void matmul(const T* a, Trans ta, const T* b, Trans tb, T* c, int m, int n, int k, bool accumulate);

// nn.Linear: y (rows, out) = x (rows, in) w^T + b, w (out, in), b (out) or null.
template <typename T>
void linear_forward(const T* x, const T* w, const T* b, T* y, int rows, int in, int out);
// dx (rows, in) = dy w (skipped when dx is null); dw (out, in) += dy^T x;
// db (out) += the column sums of dy (skipped when db is null).
template <typename T>
void linear_backward(const T* x, const T* w, const T* dy, T* dx, T* dw, T* db, int rows, int in, int out);

inline constexpr double kLayerNormEps = 1e-5;

// LayerNorm over each row of x (rows, dim): y = (x - mean) * rstd * g + b,
// rstd = 1 / sqrt(var + 1e-5) with the biased variance. mean, rstd: (rows,),
// saved for backward.
template <typename T>
void layernorm_forward(const T* x, const T* g, const T* b, T* y, T* mean, T* rstd, int rows, int dim);
// dx (rows, dim) overwritten; dg, db (dim) accumulated.
template <typename T>
void layernorm_backward(const T* x, const T* g, const T* mean, const T* rstd, const T* dy, T* dx, T* dg, T* db,
                        int rows, int dim);

// GELU, GPT-2's tanh approximation:
// y = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). Element-wise over n;
// backward may run in place (dx == dy).
template <typename T>
void gelu_forward(const T* x, T* y, std::size_t n);
template <typename T>
void gelu_backward(const T* x, const T* dy, T* dx, std::size_t n);

struct AttentionShape {
  int batch = 1;
  int seq = 1;
  int heads = 1;
  int dim = 1;   // model width; each head has dim / heads
};

// Causal multi-head self-attention on fused projections qkv (batch * seq,
// 3 * dim), each row [q | k | v] with head h at columns h * dim / heads.
// out (batch * seq, dim): the heads' outputs side by side, before the output
// projection. probs (batch, heads, seq, seq): the softmax, zero above the
// diagonal, saved for backward. Scores are scaled by 1 / sqrt(dim / heads).
template <typename T>
void attention_forward(const T* qkv, T* out, T* probs, const AttentionShape& shape);
// dqkv (batch * seq, 3 * dim) overwritten.
template <typename T>
void attention_backward(const T* qkv, const T* probs, const T* dout, T* dqkv, const AttentionShape& shape);

// x (batch * seq, dim) = wte[tokens] + wpe[position]; tokens (batch * seq,)
// must lie in [0, vocab) (checked by the caller). wte (vocab, dim), wpe (>= seq, dim).
template <typename T>
void embedding_forward(const std::int32_t* tokens, const T* wte, const T* wpe, T* x, int batch, int seq, int dim);
// dwte, dwpe accumulated.
template <typename T>
void embedding_backward(const std::int32_t* tokens, const T* dx, T* dwte, T* dwpe, int batch, int seq, int dim);

// The mean over rows of -log softmax(logits)[target]; logits (rows, vocab).
// dlogits (rows, vocab) = d(scale * loss) / dlogits, overwritten (skipped when
// null). Returns the unscaled loss, summed in double in row order.
template <typename T>
double cross_entropy(const T* logits, const std::int32_t* targets, T* dlogits, int rows, int vocab, double scale);

}  // namespace tz::train
