// The GPT operators (tierzero/train/ops.h) except matmul (matmul.cpp).
//
// Note [Deterministic reductions]
// Sums that run across rows (bias and LayerNorm gradients, embedding
// gradients) are split over the cores by columns, never by rows: each thread
// owns a range of columns and walks the rows in order, so every sum has one
// fixed order. Row-wise work (LayerNorm, softmax, cross-entropy) is split by
// rows, each row on one thread. Together with matmul's fixed k order this
// makes every result a function of the inputs alone, whatever the thread
// count or scheduling: the engine-driven trainer and the in-memory reference
// compute identical gradients from identical weights.
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "tierzero/train/ops.h"

namespace tz::train {
namespace {

// Runs body(begin, end) over [0, n) in parallel, in chunks of at least `grain`.
template <typename F>
void parallel_chunks(std::size_t n, std::size_t grain, const F& body) {
  if (n <= grain) {
    body(std::size_t{0}, n);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, grain),
                    [&](const tbb::blocked_range<std::size_t>& r) { body(r.begin(), r.end()); });
}

// out[j] += sum over rows r of f(r, j), rows in order, split by columns.
template <typename T, typename F>
void column_sums(T* out, int rows, int cols, const F& f) {
  parallel_chunks(static_cast<std::size_t>(cols), 64, [&](std::size_t j0, std::size_t j1) {
    for (int r = 0; r < rows; ++r) {
      for (std::size_t j = j0; j < j1; ++j) out[j] += f(r, j);
    }
  });
}

constexpr std::size_t kRowGrain = 4;

}  // namespace

// ---------------------------------------------------------------- linear

template <typename T>
void linear_forward(const T* x, const T* w, const T* b, T* y, int rows, int in, int out) {
  if (b != nullptr) {
    parallel_chunks(static_cast<std::size_t>(rows), 64, [&](std::size_t r0, std::size_t r1) {
      for (std::size_t r = r0; r < r1; ++r) std::copy(b, b + out, y + r * out);
    });
  }
  matmul(x, Trans::kNo, w, Trans::kYes, y, rows, out, in, /*accumulate=*/b != nullptr);
}

template <typename T>
void linear_backward(const T* x, const T* w, const T* dy, T* dx, T* dw, T* db, int rows, int in, int out) {
  if (dx != nullptr) matmul(dy, Trans::kNo, w, Trans::kNo, dx, rows, in, out, false);
  matmul(dy, Trans::kYes, x, Trans::kNo, dw, out, in, rows, true);
  if (db != nullptr) {
    column_sums(db, rows, out, [&](int r, std::size_t j) { return dy[static_cast<std::size_t>(r) * out + j]; });
  }
}

// ---------------------------------------------------------------- LayerNorm

template <typename T>
void layernorm_forward(const T* x, const T* g, const T* b, T* y, T* mean, T* rstd, int rows, int dim) {
  parallel_chunks(static_cast<std::size_t>(rows), kRowGrain, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      const T* xr = x + r * dim;
      T sum = 0;
      for (int j = 0; j < dim; ++j) sum += xr[j];
      const T mu = sum / static_cast<T>(dim);
      T var = 0;
      for (int j = 0; j < dim; ++j) var += (xr[j] - mu) * (xr[j] - mu);
      const T rs = static_cast<T>(1) / std::sqrt(var / static_cast<T>(dim) + static_cast<T>(kLayerNormEps));
      T* yr = y + r * dim;
      for (int j = 0; j < dim; ++j) yr[j] = (xr[j] - mu) * rs * g[j] + b[j];
      mean[r] = mu;
      rstd[r] = rs;
    }
  });
}

template <typename T>
void layernorm_backward(const T* x, const T* g, const T* mean, const T* rstd, const T* dy, T* dx, T* dg, T* db,
                        int rows, int dim) {
  // dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), dxhat = dy g.
  parallel_chunks(static_cast<std::size_t>(rows), kRowGrain, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      const T* xr = x + r * dim;
      const T* dyr = dy + r * dim;
      T sum_dxhat = 0, sum_dxhat_xhat = 0;
      for (int j = 0; j < dim; ++j) {
        const T xhat = (xr[j] - mean[r]) * rstd[r];
        const T dxhat = dyr[j] * g[j];
        sum_dxhat += dxhat;
        sum_dxhat_xhat += dxhat * xhat;
      }
      const T a = sum_dxhat / static_cast<T>(dim), c = sum_dxhat_xhat / static_cast<T>(dim);
      T* dxr = dx + r * dim;
      for (int j = 0; j < dim; ++j) {
        const T xhat = (xr[j] - mean[r]) * rstd[r];
        dxr[j] = rstd[r] * (dyr[j] * g[j] - a - xhat * c);
      }
    }
  });
  auto at = [dim](int r, std::size_t j) { return static_cast<std::size_t>(r) * dim + j; };
  column_sums(dg, rows, dim, [&](int r, std::size_t j) { return dy[at(r, j)] * ((x[at(r, j)] - mean[r]) * rstd[r]); });
  column_sums(db, rows, dim, [&](int r, std::size_t j) { return dy[at(r, j)]; });
}

// ---------------------------------------------------------------- GELU

namespace {
constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluA = 0.044715;
}  // namespace

template <typename T>
void gelu_forward(const T* x, T* y, std::size_t n) {
  parallel_chunks(n, 4096, [&](std::size_t i0, std::size_t i1) {
    for (std::size_t i = i0; i < i1; ++i) {
      const T v = x[i];
      y[i] = static_cast<T>(0.5) * v * (1 + std::tanh(static_cast<T>(kGeluC) * (v + static_cast<T>(kGeluA) * v * v * v)));
    }
  });
}

template <typename T>
void gelu_backward(const T* x, const T* dy, T* dx, std::size_t n) {
  parallel_chunks(n, 4096, [&](std::size_t i0, std::size_t i1) {
    for (std::size_t i = i0; i < i1; ++i) {
      const T v = x[i];
      const T t = std::tanh(static_cast<T>(kGeluC) * (v + static_cast<T>(kGeluA) * v * v * v));
      const T dt = (1 - t * t) * static_cast<T>(kGeluC) * (1 + static_cast<T>(3 * kGeluA) * v * v);
      dx[i] = dy[i] * (static_cast<T>(0.5) * (1 + t) + static_cast<T>(0.5) * v * dt);
    }
  });
}

// ---------------------------------------------------------------- embedding

template <typename T>
void embedding_forward(const std::int32_t* tokens, const T* wte, const T* wpe, T* x, int batch, int seq, int dim) {
  parallel_chunks(static_cast<std::size_t>(batch) * seq, 16, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      const T* te = wte + static_cast<std::size_t>(tokens[r]) * dim;
      const T* pe = wpe + (r % seq) * dim;
      for (int j = 0; j < dim; ++j) x[r * dim + j] = te[j] + pe[j];
    }
  });
}

template <typename T>
void embedding_backward(const std::int32_t* tokens, const T* dx, T* dwte, T* dwpe, int batch, int seq, int dim) {
  const int rows = batch * seq;
  parallel_chunks(static_cast<std::size_t>(dim), 64, [&](std::size_t j0, std::size_t j1) {
    for (int r = 0; r < rows; ++r) {
      T* te = dwte + static_cast<std::size_t>(tokens[r]) * dim;
      T* pe = dwpe + static_cast<std::size_t>(r % seq) * dim;
      for (std::size_t j = j0; j < j1; ++j) {
        te[j] += dx[static_cast<std::size_t>(r) * dim + j];
        pe[j] += dx[static_cast<std::size_t>(r) * dim + j];
      }
    }
  });
}

// ---------------------------------------------------------------- cross-entropy

template <typename T>
double cross_entropy(const T* logits, const std::int32_t* targets, T* dlogits, int rows, int vocab, double scale) {
  std::vector<double> row_loss(static_cast<std::size_t>(rows));
  const T grad_scale = static_cast<T>(scale / rows);
  parallel_chunks(static_cast<std::size_t>(rows), kRowGrain, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t r = r0; r < r1; ++r) {
      const T* lr = logits + r * vocab;
      const T mx = *std::max_element(lr, lr + vocab);
      T sum = 0;
      for (int j = 0; j < vocab; ++j) sum += std::exp(lr[j] - mx);
      const T log_sum = std::log(sum);
      row_loss[r] = static_cast<double>(log_sum + mx - lr[targets[r]]);
      if (dlogits == nullptr) continue;
      T* dr = dlogits + r * vocab;
      for (int j = 0; j < vocab; ++j) dr[j] = std::exp(lr[j] - mx - log_sum) * grad_scale;
      dr[targets[r]] -= grad_scale;
    }
  });
  double total = 0;
  for (double l : row_loss) total += l;
  return total / rows;
}

// ---------------------------------------------------------------- instantiations

#define TZ_TRAIN_INSTANTIATE(T)                                                                                   \
  template void linear_forward<T>(const T*, const T*, const T*, T*, int, int, int);                              \
  template void linear_backward<T>(const T*, const T*, const T*, T*, T*, T*, int, int, int);                     \
  template void layernorm_forward<T>(const T*, const T*, const T*, T*, T*, T*, int, int);                        \
  template void layernorm_backward<T>(const T*, const T*, const T*, const T*, const T*, T*, T*, T*, int, int);   \
  template void gelu_forward<T>(const T*, T*, std::size_t);                                                      \
  template void gelu_backward<T>(const T*, const T*, T*, std::size_t);                                           \
  template void embedding_forward<T>(const std::int32_t*, const T*, const T*, T*, int, int, int);                \
  template void embedding_backward<T>(const std::int32_t*, const T*, T*, T*, int, int, int);                     \
  template double cross_entropy<T>(const T*, const std::int32_t*, T*, int, int, double);
TZ_TRAIN_INSTANTIATE(float)
TZ_TRAIN_INSTANTIATE(double)
#undef TZ_TRAIN_INSTANTIATE

}  // namespace tz::train
