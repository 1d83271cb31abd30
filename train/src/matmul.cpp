// matmul (tierzero/train/ops.h): a register-tiled fp32 kernel, and a plain
// double loop for the reference checks.
//
// Note [Matmul kernel]
// Operands are first brought to the (m, k) x (k, n) form by transposing into
// scratch (an O(size) copy against O(m n k) work). C is cut into tiles of
// 6 rows x 16 columns; a tile keeps its 12 8-wide accumulators in registers
// while k runs, each step loading 16 floats of a B row and broadcasting one A
// element per row (the classic AVX2 6x16 shape: 12 accumulators + 2 B vectors
// + 1 broadcast fit the 16 vector registers). k is walked in chunks of 256 so
// the B stripe stays in L2; a chunk continues from the accumulators it left
// in C, so every element still sums over k in ascending order and the result
// does not depend on how oneTBB splits the tiles. The tile loop is compiled
// twice (x86-64-v3: AVX2 + FMA, and the baseline) and the loader picks one
// at run time, so one binary runs everywhere and is fast where it can be.
#include <tbb/blocked_range.h>
#include <tbb/blocked_range2d.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "tierzero/train/ops.h"

namespace tz::train {
namespace {

constexpr int kTileRows = 6;
constexpr int kTileCols = 16;
constexpr int kChunkK = 256;

using v8f = float __attribute__((vector_size(32), aligned(4)));

template <int R>
__attribute__((always_inline)) inline void tile(const float* a, int lda, const float* b, int ldb, float* c, int ldc,
                                                int k0, int k1) {
  v8f acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    std::memcpy(&acc[r][0], c + static_cast<std::size_t>(r) * ldc, sizeof(v8f));
    std::memcpy(&acc[r][1], c + static_cast<std::size_t>(r) * ldc + 8, sizeof(v8f));
  }
  for (int k = k0; k < k1; ++k) {
    v8f b0, b1;
    std::memcpy(&b0, b + static_cast<std::size_t>(k) * ldb, sizeof(v8f));
    std::memcpy(&b1, b + static_cast<std::size_t>(k) * ldb + 8, sizeof(v8f));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float x = a[static_cast<std::size_t>(r) * lda + k];
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    std::memcpy(c + static_cast<std::size_t>(r) * ldc, &acc[r][0], sizeof(v8f));
    std::memcpy(c + static_cast<std::size_t>(r) * ldc + 8, &acc[r][1], sizeof(v8f));
  }
}

struct Region {
  int row_tile_begin, row_tile_end;  // in tiles of kTileRows
  int col_tile_begin, col_tile_end;  // in tiles of kTileCols; col_tile_end * 16 may pass n: the tail is scalar
};

// c[rows, cols of the region] += a b over all of k, tile by tile (Note [Matmul kernel]).
__attribute__((target_clones("arch=x86-64-v3", "default"))) void gemm_region(const float* a, const float* b, float* c,
                                                                             int m, int n, int k, Region reg) {
  const int full_cols = n / kTileCols;
  for (int k0 = 0; k0 < k; k0 += kChunkK) {
    const int k1 = std::min(k, k0 + kChunkK);
    for (int ti = reg.row_tile_begin; ti < reg.row_tile_end; ++ti) {
      const int i0 = ti * kTileRows;
      const int rows = std::min(kTileRows, m - i0);
      const float* ai = a + static_cast<std::size_t>(i0) * k;
      for (int tj = reg.col_tile_begin; tj < std::min(reg.col_tile_end, full_cols); ++tj) {
        float* ci = c + static_cast<std::size_t>(i0) * n + tj * kTileCols;
        const float* bj = b + tj * kTileCols;
        switch (rows) {
          case 6: tile<6>(ai, k, bj, n, ci, n, k0, k1); break;
          case 5: tile<5>(ai, k, bj, n, ci, n, k0, k1); break;
          case 4: tile<4>(ai, k, bj, n, ci, n, k0, k1); break;
          case 3: tile<3>(ai, k, bj, n, ci, n, k0, k1); break;
          case 2: tile<2>(ai, k, bj, n, ci, n, k0, k1); break;
          default: tile<1>(ai, k, bj, n, ci, n, k0, k1); break;
        }
      }
      if (reg.col_tile_end > full_cols) {  // the last tile column holds the n % 16 tail
        for (int i = i0; i < i0 + rows; ++i) {
          for (int j = full_cols * kTileCols; j < n; ++j) {
            float acc = c[static_cast<std::size_t>(i) * n + j];
            for (int kk = k0; kk < k1; ++kk) acc += a[static_cast<std::size_t>(i) * k + kk] * b[static_cast<std::size_t>(kk) * n + j];
            c[static_cast<std::size_t>(i) * n + j] = acc;
          }
        }
      }
    }
  }
}

void gemm_nn(const float* a, const float* b, float* c, int m, int n, int k) {
  const int row_tiles = (m + kTileRows - 1) / kTileRows;
  const int col_tiles = (n + kTileCols - 1) / kTileCols;
  const double work = static_cast<double>(m) * n * k;
  if (work < 1 << 18) {  // too small to be worth a task
    gemm_region(a, b, c, m, n, k, {0, row_tiles, 0, col_tiles});
    return;
  }
  tbb::parallel_for(tbb::blocked_range2d<int>(0, row_tiles, 8, 0, col_tiles, 8), [&](const tbb::blocked_range2d<int>& r) {
    gemm_region(a, b, c, m, n, k, {r.rows().begin(), r.rows().end(), r.cols().begin(), r.cols().end()});
  });
}

// dst (cols, rows) = src (rows, cols)^T.
template <typename T>
void transpose(const T* src, T* dst, int rows, int cols) {
  constexpr int kBlock = 32;
  auto body = [&](const tbb::blocked_range<int>& rb) {
    for (int i0 = rb.begin() * kBlock; i0 < std::min(rows, rb.end() * kBlock); i0 += kBlock) {
      for (int j0 = 0; j0 < cols; j0 += kBlock) {
        for (int i = i0; i < std::min(rows, i0 + kBlock); ++i) {
          for (int j = j0; j < std::min(cols, j0 + kBlock); ++j) {
            dst[static_cast<std::size_t>(j) * rows + i] = src[static_cast<std::size_t>(i) * cols + j];
          }
        }
      }
    }
  };
  const int blocks = (rows + kBlock - 1) / kBlock;
  if (static_cast<double>(rows) * cols < 1 << 16) {
    body(tbb::blocked_range<int>(0, blocks));
  } else {
    tbb::parallel_for(tbb::blocked_range<int>(0, blocks), body);
  }
}

// Brings op(a) and op(b) to plain (m, k) and (k, n) operands.
template <typename T>
void normalise(const T*& a, Trans ta, const T*& b, Trans tb, int m, int n, int k, std::vector<T>& at,
               std::vector<T>& bt) {
  if (ta == Trans::kYes) {
    at.resize(static_cast<std::size_t>(m) * k);
    transpose(a, at.data(), k, m);
    a = at.data();
  }
  if (tb == Trans::kYes) {
    bt.resize(static_cast<std::size_t>(k) * n);
    transpose(b, bt.data(), n, k);
    b = bt.data();
  }
}

}  // namespace

template <>
void matmul<float>(const float* a, Trans ta, const float* b, Trans tb, float* c, int m, int n, int k, bool accumulate) {
  if (!accumulate) std::fill(c, c + static_cast<std::size_t>(m) * n, 0.0F);
  if (m <= 0 || n <= 0 || k <= 0) return;
  std::vector<float> at, bt;  // per call, not thread_local: a waiting TBB thread may run another matmul
  normalise(a, ta, b, tb, m, n, k, at, bt);
  gemm_nn(a, b, c, m, n, k);
}

template <>
void matmul<double>(const double* a, Trans ta, const double* b, Trans tb, double* c, int m, int n, int k,
                    bool accumulate) {
  if (!accumulate) std::fill(c, c + static_cast<std::size_t>(m) * n, 0.0);
  if (m <= 0 || n <= 0 || k <= 0) return;
  std::vector<double> at, bt;
  normalise(a, ta, b, tb, m, n, k, at, bt);
  tbb::parallel_for(tbb::blocked_range<int>(0, m), [&](const tbb::blocked_range<int>& rows) {
    for (int i = rows.begin(); i < rows.end(); ++i) {
      double* ci = c + static_cast<std::size_t>(i) * n;
      for (int kk = 0; kk < k; ++kk) {
        const double x = a[static_cast<std::size_t>(i) * k + kk];
        const double* bk = b + static_cast<std::size_t>(kk) * n;
        for (int j = 0; j < n; ++j) ci[j] += x * bk[j];
      }
    }
  });
}

}  // namespace tz::train
