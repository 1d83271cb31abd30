// Causal multi-head self-attention (tierzero/train/ops.h), one oneTBB task per
// (sequence, head): each gathers its q, k, v (seq, head_dim) out of the fused
// qkv rows, works on them with matmul, and scatters its result back, so tasks
// never write the same element.
//
//   forward:  S = q k^T / sqrt(d), P = softmax over j <= i (0 above), O = P v
//   backward: dP = dO v^T, dV = P^T dO,
//             dS = P * (dP - rowsum(P * dP)) / sqrt(d), dQ = dS k, dK = dS^T q
// The full S is computed and the upper triangle ignored: at the sequence
// lengths the CPU trainer runs, a triangular kernel would save little.
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "tierzero/train/ops.h"

namespace tz::train {
namespace {

struct HeadView {
  int seq, head_dim, dim;
  std::size_t row0;  // first row of the sequence in (batch * seq, .)
  int col0;          // the head's first column within q (k, v: + dim, + 2 dim)
};

// dst (seq, head_dim) = the head's columns of part (0 q, 1 k, 2 v) of qkv.
template <typename T>
void gather(const T* qkv, const HeadView& h, int part, T* dst) {
  for (int t = 0; t < h.seq; ++t) {
    const T* src = qkv + (h.row0 + t) * 3 * h.dim + part * h.dim + h.col0;
    std::copy(src, src + h.head_dim, dst + static_cast<std::size_t>(t) * h.head_dim);
  }
}

// The head's columns of `out` (row stride `stride`, offset `col`) = src (seq, head_dim).
template <typename T>
void scatter(const T* src, const HeadView& h, T* out, int stride, int col) {
  for (int t = 0; t < h.seq; ++t) {
    std::copy(src + static_cast<std::size_t>(t) * h.head_dim, src + static_cast<std::size_t>(t + 1) * h.head_dim,
              out + (h.row0 + t) * stride + col);
  }
}

template <typename T>
void for_each_head(const AttentionShape& s, const auto& body) {
  tbb::parallel_for(tbb::blocked_range<int>(0, s.batch * s.heads), [&](const tbb::blocked_range<int>& r) {
    for (int bh = r.begin(); bh < r.end(); ++bh) {
      const int b = bh / s.heads, h = bh % s.heads;
      const int hd = s.dim / s.heads;
      body(bh, HeadView{s.seq, hd, s.dim, static_cast<std::size_t>(b) * s.seq, h * hd});
    }
  });
}

}  // namespace

template <typename T>
void attention_forward(const T* qkv, T* out, T* probs, const AttentionShape& s) {
  for_each_head<T>(s, [&](int bh, const HeadView& h) {
    const std::size_t td = static_cast<std::size_t>(h.seq) * h.head_dim;
    std::vector<T> q(td), k(td), v(td), o(td);
    gather(qkv, h, 0, q.data());
    gather(qkv, h, 1, k.data());
    gather(qkv, h, 2, v.data());
    T* p = probs + static_cast<std::size_t>(bh) * h.seq * h.seq;
    matmul(q.data(), Trans::kNo, k.data(), Trans::kYes, p, h.seq, h.seq, h.head_dim, false);
    const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(h.head_dim)));
    for (int i = 0; i < h.seq; ++i) {
      T* row = p + static_cast<std::size_t>(i) * h.seq;
      T mx = row[0] * scale;
      for (int j = 1; j <= i; ++j) mx = std::max(mx, row[j] * scale);
      T sum = 0;
      for (int j = 0; j <= i; ++j) {
        row[j] = std::exp(row[j] * scale - mx);
        sum += row[j];
      }
      for (int j = 0; j <= i; ++j) row[j] /= sum;
      std::fill(row + i + 1, row + h.seq, T{0});
    }
    matmul(p, Trans::kNo, v.data(), Trans::kNo, o.data(), h.seq, h.head_dim, h.seq, false);
    scatter(o.data(), h, out, h.dim, h.col0);
  });
}

template <typename T>
void attention_backward(const T* qkv, const T* probs, const T* dout, T* dqkv, const AttentionShape& s) {
  for_each_head<T>(s, [&](int bh, const HeadView& h) {
    const std::size_t td = static_cast<std::size_t>(h.seq) * h.head_dim;
    const std::size_t tt = static_cast<std::size_t>(h.seq) * h.seq;
    std::vector<T> q(td), k(td), v(td), dout_h(td), dq(td), dk(td), dv(td), ds(tt);
    gather(qkv, h, 0, q.data());
    gather(qkv, h, 1, k.data());
    gather(qkv, h, 2, v.data());
    for (int t = 0; t < h.seq; ++t) {
      const T* src = dout + (h.row0 + t) * h.dim + h.col0;
      std::copy(src, src + h.head_dim, dout_h.data() + static_cast<std::size_t>(t) * h.head_dim);
    }
    const T* p = probs + static_cast<std::size_t>(bh) * tt;
    matmul(dout_h.data(), Trans::kNo, v.data(), Trans::kYes, ds.data(), h.seq, h.seq, h.head_dim, false);  // dP
    matmul(p, Trans::kYes, dout_h.data(), Trans::kNo, dv.data(), h.seq, h.head_dim, h.seq, false);
    const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(h.head_dim)));
    for (int i = 0; i < h.seq; ++i) {
      const T* pr = p + static_cast<std::size_t>(i) * h.seq;
      T* dr = ds.data() + static_cast<std::size_t>(i) * h.seq;
      T dot = 0;
      for (int j = 0; j <= i; ++j) dot += pr[j] * dr[j];
      for (int j = 0; j <= i; ++j) dr[j] = pr[j] * (dr[j] - dot) * scale;
      std::fill(dr + i + 1, dr + h.seq, T{0});
    }
    matmul(ds.data(), Trans::kNo, k.data(), Trans::kNo, dq.data(), h.seq, h.head_dim, h.seq, false);
    matmul(ds.data(), Trans::kYes, q.data(), Trans::kNo, dk.data(), h.seq, h.head_dim, h.seq, false);
    scatter(dq.data(), h, dqkv, 3 * h.dim, h.col0);
    scatter(dk.data(), h, dqkv, 3 * h.dim, h.dim + h.col0);
    scatter(dv.data(), h, dqkv, 3 * h.dim, 2 * h.dim + h.col0);
  });
}

template void attention_forward<float>(const float*, float*, float*, const AttentionShape&);
template void attention_forward<double>(const double*, double*, double*, const AttentionShape&);
template void attention_backward<float>(const float*, const float*, const float*, float*, const AttentionShape&);
template void attention_backward<double>(const double*, const double*, const double*, double*, const AttentionShape&);

}  // namespace tz::train
