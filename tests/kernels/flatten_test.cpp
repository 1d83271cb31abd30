// flatten / unflatten: the CPU twins against plain indexing, and the CUDA
// launch against the twins (skipped, saying why, without a GPU), on fresh
// random bytes, with slices that are aligned, misaligned, empty, smaller than
// a vector and larger than a chunk.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "tierzero/kernels.h"

#if defined(TIERZERO_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace tz::kernels {
namespace {

struct Case {
  std::vector<std::vector<std::uint8_t>> tensors;
  std::vector<std::size_t> offsets;
  std::size_t flat_bytes = 0;
};

// Slices of every awkward size at every awkward offset, with gaps between them.
Case make_case(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::size_t sizes[] = {0, 1, 15, 16, 17, 4096, 65536, 65537, 300'001, 3};
  Case c;
  std::size_t at = 0;
  for (std::size_t bytes : sizes) {
    at += rng() % 3 == 0 ? 0 : rng() % 37;  // sometimes aligned, sometimes not
    std::vector<std::uint8_t> t(bytes);
    for (auto& b : t) b = static_cast<std::uint8_t>(rng());
    c.offsets.push_back(at);
    c.tensors.push_back(std::move(t));
    at += bytes;
  }
  c.flat_bytes = at + 5;
  return c;
}

std::vector<Slice> slices_of(Case& c, const std::vector<void*>& where) {
  std::vector<Slice> s;
  for (std::size_t i = 0; i < c.tensors.size(); ++i) s.push_back({where[i], c.offsets[i], c.tensors[i].size()});
  return s;
}

TEST(Flatten, CpuTwinsPlaceEveryByteAndTouchNothingElse) {
  Case c = make_case(std::random_device{}());
  std::vector<void*> where;
  for (auto& t : c.tensors) where.push_back(t.data());
  const std::vector<Slice> s = slices_of(c, where);
  std::vector<std::uint8_t> flat(c.flat_bytes, 0xAB);
  flatten_cpu(s.data(), s.size(), flat.data());
  std::vector<bool> covered(flat.size(), false);
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    for (std::size_t j = 0; j < c.tensors[i].size(); ++j) {
      ASSERT_EQ(flat[c.offsets[i] + j], c.tensors[i][j]) << "slice " << i << " byte " << j;
      covered[c.offsets[i] + j] = true;
    }
  }
  for (std::size_t k = 0; k < flat.size(); ++k) {
    if (!covered[k]) {
      ASSERT_EQ(flat[k], 0xAB) << "byte " << k << " lies in no slice but was written";
    }
  }
  // Back out into fresh tensors.
  std::vector<std::vector<std::uint8_t>> back;
  std::vector<void*> out;
  for (auto& t : c.tensors) back.emplace_back(t.size(), 0);
  for (auto& t : back) out.push_back(t.data());
  const std::vector<Slice> r = slices_of(c, out);
  unflatten_cpu(flat.data(), r.data(), r.size());
  EXPECT_EQ(back, c.tensors);
}

// A slice with no tensor is a gap: flatten zeroes it (the engine's gradient
// buffer is filled, gaps and all, in one call), unflatten leaves it alone.
TEST(Flatten, GapSlicesAreZeroedAndSkippedOnTheWayBack) {
  Case c = make_case(std::random_device{}());
  std::vector<void*> where;
  for (auto& t : c.tensors) where.push_back(t.data());
  std::vector<Slice> s = slices_of(c, where);
  const std::size_t gaps[] = {1, 4, 7};  // 1 byte, 4096 and 65537 bytes
  for (std::size_t g : gaps) s[g].tensor = nullptr;
  std::vector<std::uint8_t> flat(c.flat_bytes, 0xAB);
  flatten_cpu(s.data(), s.size(), flat.data());
  for (std::size_t g : gaps) {
    for (std::size_t j = 0; j < c.tensors[g].size(); ++j) ASSERT_EQ(flat[c.offsets[g] + j], 0) << "gap " << g << " byte " << j;
  }
  for (std::size_t j = 0; j < c.tensors[3].size(); ++j) ASSERT_EQ(flat[c.offsets[3] + j], c.tensors[3][j]);
  // Back out: the gaps' tensors (still nullptr) are not written, the rest are.
  std::fill(flat.begin() + static_cast<std::ptrdiff_t>(c.offsets[3]),
            flat.begin() + static_cast<std::ptrdiff_t>(c.offsets[3] + c.tensors[3].size()), 0x5A);
  unflatten_cpu(flat.data(), s.data(), s.size());
  EXPECT_EQ(c.tensors[3], std::vector<std::uint8_t>(c.tensors[3].size(), 0x5A));
}

TEST(FlattenCuda, MatchesTheCpuTwinsByteForByte) {
#if !defined(TIERZERO_WITH_CUDA)
  GTEST_SKIP() << "built without CUDA (-DTIERZERO_CUDA=OFF)";
#else
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no CUDA device: " << cudaGetErrorString(cudaGetLastError());
  }
  Case c = make_case(std::random_device{}());
  // Device copies of the tensors, and a poisoned flat buffer.
  std::vector<void*> d_tensors;
  for (auto& t : c.tensors) {
    void* d = nullptr;
    ASSERT_EQ(cudaMalloc(&d, t.size() + 1), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d, t.data(), t.size(), cudaMemcpyHostToDevice), cudaSuccess);
    d_tensors.push_back(d);
  }
  void* d_flat = nullptr;
  ASSERT_EQ(cudaMalloc(&d_flat, c.flat_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_flat, 0xAB, c.flat_bytes), cudaSuccess);
  const std::vector<Slice> d_slices = slices_of(c, d_tensors);
  std::vector<void*> h_tensors;
  for (auto& t : c.tensors) h_tensors.push_back(t.data());
  const std::vector<Slice> h_slices = slices_of(c, h_tensors);
  std::vector<std::uint8_t> got(c.flat_bytes), want(c.flat_bytes, 0xAB);
  // First with gaps (tensor nullptr: zeros), unaligned and over a chunk among them.
  {
    std::vector<Slice> d_gapped = d_slices, h_gapped = h_slices;
    for (std::size_t g : {1, 4, 7}) d_gapped[g].tensor = h_gapped[g].tensor = nullptr;
    ASSERT_TRUE(flatten_cuda(d_gapped.data(), d_gapped.size(), d_flat, nullptr).ok());
    ASSERT_EQ(cudaMemcpy(got.data(), d_flat, c.flat_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    flatten_cpu(h_gapped.data(), h_gapped.size(), want.data());
    EXPECT_EQ(got, want);
    ASSERT_EQ(cudaMemset(d_flat, 0xAB, c.flat_bytes), cudaSuccess);
    std::fill(want.begin(), want.end(), 0xAB);
  }
  ASSERT_TRUE(flatten_cuda(d_slices.data(), d_slices.size(), d_flat, nullptr).ok());
  ASSERT_EQ(cudaMemcpy(got.data(), d_flat, c.flat_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  flatten_cpu(h_slices.data(), h_slices.size(), want.data());
  EXPECT_EQ(got, want);
  // Unflatten into zeroed device tensors.
  for (std::size_t i = 0; i < d_tensors.size(); ++i) ASSERT_EQ(cudaMemset(d_tensors[i], 0, c.tensors[i].size()), cudaSuccess);
  ASSERT_TRUE(unflatten_cuda(d_flat, d_slices.data(), d_slices.size(), nullptr).ok());
  for (std::size_t i = 0; i < d_tensors.size(); ++i) {
    std::vector<std::uint8_t> back(c.tensors[i].size());
    ASSERT_EQ(cudaMemcpy(back.data(), d_tensors[i], back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(back, c.tensors[i]) << "slice " << i;
    cudaFree(d_tensors[i]);
  }
  cudaFree(d_flat);
#endif
}

}  // namespace
}  // namespace tz::kernels
