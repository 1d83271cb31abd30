// Flatten / unflatten on the GPU: one launch copies every slice.
//
// Note [Copy chunks]
// Each slice is cut into chunks of kChunkBytes; one thread block copies one
// chunk, so a big tensor and many small ones spread evenly over the GPU. A
// chunk whose source and destination are both 16-byte aligned (the usual
// case: the engine aligns parameters to 64 bytes) moves in 16-byte vectors;
// any other chunk, and a chunk's ragged tail, byte by byte. A chunk with no
// source (a gap, flatten only) is written with zeros the same way.
#include <vector>

#include "cuda_launch.h"

namespace tz::kernels::launch {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kChunkBytes = 64 * 1024;

struct Chunk {
  char* dst;
  const char* src;
  unsigned long long bytes;
};

__global__ void copy_chunks_kernel(const Chunk* __restrict__ chunks) {
  const Chunk c = chunks[blockIdx.x];
  const bool aligned = ((reinterpret_cast<unsigned long long>(c.dst) | reinterpret_cast<unsigned long long>(c.src)) & 15) == 0;
  unsigned long long done = 0;
  if (aligned) {
    const unsigned long long vectors = c.bytes / 16;
    auto* d = reinterpret_cast<uint4*>(c.dst);
    const auto* s = reinterpret_cast<const uint4*>(c.src);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (unsigned long long i = threadIdx.x; i < vectors; i += kThreads) d[i] = s != nullptr ? s[i] : zero;
    done = vectors * 16;
  }
  for (unsigned long long i = done + threadIdx.x; i < c.bytes; i += kThreads) c.dst[i] = c.src != nullptr ? c.src[i] : 0;
}

}  // namespace

cudaError_t copy_slices(const Copy* copies, std::size_t count, cudaStream_t stream) {
  std::vector<Chunk> chunks;
  for (std::size_t i = 0; i < count; ++i) {
    for (std::size_t at = 0; at < copies[i].bytes; at += kChunkBytes) {
      const std::size_t len = copies[i].bytes - at < kChunkBytes ? copies[i].bytes - at : kChunkBytes;
      const char* src = copies[i].src != nullptr ? static_cast<const char*>(copies[i].src) + at : nullptr;
      chunks.push_back({static_cast<char*>(copies[i].dst) + at, src, len});
    }
  }
  if (chunks.empty()) return cudaSuccess;
  const std::size_t table = chunks.size() * sizeof(Chunk);
  void* d_chunks = nullptr;
  cudaError_t err = cudaMallocAsync(&d_chunks, table, stream);
  // A pageable source: cudaMemcpyAsync has staged it when it returns, so `chunks` may go.
  if (err == cudaSuccess) err = cudaMemcpyAsync(d_chunks, chunks.data(), table, cudaMemcpyHostToDevice, stream);
  if (err == cudaSuccess) {
    // One block per chunk, in grid-sized launches (gridDim.x is at most 2^31 - 1).
    constexpr std::size_t kMaxGrid = 1u << 30;
    for (std::size_t first = 0; first < chunks.size() && err == cudaSuccess; first += kMaxGrid) {
      const std::size_t n = chunks.size() - first < kMaxGrid ? chunks.size() - first : kMaxGrid;
      copy_chunks_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(static_cast<const Chunk*>(d_chunks) + first);
      err = cudaGetLastError();
    }
  }
  if (d_chunks != nullptr) cudaFreeAsync(d_chunks, stream);
  return err;
}

}  // namespace tz::kernels::launch
