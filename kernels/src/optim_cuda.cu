// CUDA optimizer kernels (tierzero/kernels.h): unscale with an inf/NaN flag,
// multi-tensor squared norms, Adam/AdamW with the bf16 copy-out, and Adam on
// the compact formats (int8 moments by block: Note [Int8 moments on the GPU]).
//
// Note [Deterministic norms]
// The squared norms cut every tensor into chunks of kNormChunk elements; one
// block sums one chunk (fp32 per thread over a fixed stride, then a fixed
// shared-memory tree in double), writing one partial per chunk; a second
// kernel adds each tensor's partials in chunk order. Nothing depends on
// scheduling or atomics, so the same inputs give the same bits on every run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <vector>

#include "cuda_launch.h"
#include "int8_math.h"

namespace tz::kernels::launch {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kNormChunk = 65536;

unsigned grid_for(std::size_t n) {
  constexpr std::size_t kMaxBlocks = 65535 * 8;
  const std::size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks == 0 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks));
}

__global__ void unscale_kernel(float* __restrict__ g, std::size_t n, float inv_scale, int* found) {
  bool bad = false;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float x = g[i];
    const float y = x * inv_scale;
    bad |= !isfinite(x) || !isfinite(y);
    g[i] = y;
  }
  if (bad) *found = 1;  // every writer writes the same value
}

struct NormChunk {
  const float* data;
  unsigned long long numel;
};

__global__ void norm_partials_kernel(const NormChunk* __restrict__ chunks, double* __restrict__ partials) {
  __shared__ double tree[kThreads];
  const NormChunk c = chunks[blockIdx.x];
  float sum = 0;
  for (unsigned long long i = threadIdx.x; i < c.numel; i += kThreads) sum += c.data[i] * c.data[i];
  tree[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) tree[threadIdx.x] += tree[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = tree[0];
}

// first[t] .. first[t + 1]: tensor t's chunks.
__global__ void norm_finish_kernel(const double* __restrict__ partials, const unsigned long long* __restrict__ first,
                                   std::size_t count, double* __restrict__ out) {
  const std::size_t t = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (t >= count) return;
  double sum = 0;
  for (unsigned long long c = first[t]; c < first[t + 1]; ++c) sum += partials[c];
  out[t] = sum;
}

__global__ void adam_kernel(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                            float* __restrict__ v, __nv_bfloat16* __restrict__ p16, std::size_t n,
                            detail::AdamCoef coef) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float pi = p[i], mi = m[i], vi = v[i];
    detail::adam_element(pi, g[i], mi, vi, coef);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (p16 != nullptr) p16[i] = __float2bfloat16_rn(pi);
  }
}

// Note [Tie bits across threads]
// Eight elements share a tie-bit byte, so one thread per element cannot
// write its bit alone. A warp takes 32 consecutive elements, four whole
// bytes: each lane steps its element, __ballot_sync gathers the warp's new
// tie bits, and lanes 0, 8, 16 and 24 write a byte each, keeping the bits of
// elements outside [0, n) (they may belong to the next launch's range, a
// weight-decay run beside this one). The index j runs over element i =
// j - shift, where shift = tie_bit_offset % 8 aligns j's bytes with the
// array's; the loop's test is the warp's first j, so every lane of a warp
// takes part in each ballot.
__global__ void adam_compact_kernel(detail::CompactStep s, std::size_t n) {
  const std::size_t shift = s.remainder_master ? s.tie_bit_offset % 8 : 0;
  std::uint8_t* ties = s.remainder_master ? s.tie_bits + s.tie_bit_offset / 8 : nullptr;
  const std::size_t total = n + shift;
  const unsigned lane = threadIdx.x % 32;
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j - lane < total;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const bool active = j >= shift && j < total;
    bool tie = false;
    if (active && ties != nullptr) tie = ((ties[j / 8] >> (j % 8)) & 1U) != 0;
    if (active) tie = detail::adam_compact_element(s, j - shift, tie);
    if (ties == nullptr) continue;  // uniform over the launch
    const unsigned bits = __ballot_sync(0xffffffffU, tie);
    const unsigned live = __ballot_sync(0xffffffffU, active);
    const unsigned mask = (live >> lane) & 0xffU;
    if (lane % 8 == 0 && mask != 0) {
      ties[j / 8] = static_cast<std::uint8_t>((ties[j / 8] & ~mask) | ((bits >> lane) & mask));
    }
  }
}

// Note [Int8 moments on the GPU] (int8_math.h): one thread block per
// 256-element block of the codes, one thread per element. Each thread decodes
// and steps its element; the block's largest finite |m| and |v| are found by
// warp shuffles, then across the eight warps through shared memory (max is
// exact, so the tree's order does not matter); every thread then encodes its
// element with the new scales. Tie bits as in Note [Tie bits across threads]:
// a call starts at a block and tie_bit_offset is a multiple of 8, so each
// warp's four bytes are its own.
__global__ void adam_compact_int8_kernel(detail::CompactStep s, std::size_t n) {
  static_assert(kThreads == detail::kInt8BlockNumel, "one thread per element of an int8 block");
  __shared__ float warp_max[2][kThreads / 32];
  std::uint8_t* ties = s.remainder_master ? s.tie_bits + s.tie_bit_offset / 8 : nullptr;
  auto* m_codes = static_cast<std::uint8_t*>(s.exp_avg);
  auto* v_codes = static_cast<std::uint8_t*>(s.exp_avg_sq);
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::size_t blocks = (n + kThreads - 1) / kThreads;
  for (std::size_t q = blockIdx.x; q < blocks; q += gridDim.x) {  // uniform over the thread block
    const std::size_t i = q * kThreads + threadIdx.x;
    const bool active = i < n;
    float m = 0.0F, v = 0.0F;
    bool tie = false;
    if (active) {
      m = detail::int8_decode(s.exp_avg_code, m_codes[i], s.exp_avg_scale[q]);
      v = detail::int8_decode(s.exp_avg_sq_code, v_codes[i], s.exp_avg_sq_scale[q]);
      if (ties != nullptr) tie = ((ties[i / 8] >> (i % 8)) & 1U) != 0;
      tie = detail::adam_compact_update(s, i, m, v, tie);
    }
    float m_max = active ? detail::int8_finite_abs(m) : 0.0F;
    float v_max = active ? detail::int8_finite_abs(v) : 0.0F;
    for (int offset = 16; offset > 0; offset /= 2) {
      m_max = detail::int8_max(m_max, __shfl_xor_sync(0xffffffffU, m_max, offset));
      v_max = detail::int8_max(v_max, __shfl_xor_sync(0xffffffffU, v_max, offset));
    }
    if (lane == 0) {
      warp_max[0][warp] = m_max;
      warp_max[1][warp] = v_max;
    }
    if (ties != nullptr) {  // uniform over the launch
      const unsigned bits = __ballot_sync(0xffffffffU, tie);
      const unsigned live = __ballot_sync(0xffffffffU, active);
      const unsigned mask = (live >> lane) & 0xffU;
      if (lane % 8 == 0 && mask != 0) {
        ties[i / 8] = static_cast<std::uint8_t>((ties[i / 8] & ~mask) | ((bits >> lane) & mask));
      }
    }
    __syncthreads();
    for (int w = 0; w < kThreads / 32; ++w) {
      m_max = detail::int8_max(m_max, warp_max[0][w]);
      v_max = detail::int8_max(v_max, warp_max[1][w]);
    }
    const float m_scale = detail::int8_scale(s.exp_avg_code, m_max);
    const float v_scale = detail::int8_scale(s.exp_avg_sq_code, v_max);
    if (active) {
      m_codes[i] = detail::int8_encode(s.exp_avg_code, m, m_scale);
      v_codes[i] = detail::int8_encode(s.exp_avg_sq_code, v, v_scale);
    }
    if (threadIdx.x == 0) {
      s.exp_avg_scale[q] = m_scale;
      s.exp_avg_sq_scale[q] = v_scale;
    }
    __syncthreads();  // warp_max is read before the next block's writes
  }
}

template <typename T>
__device__ float grad_value(const T* g, std::size_t i);
template <>
__device__ float grad_value(const float* g, std::size_t i) { return g[i]; }
template <>
__device__ float grad_value(const __nv_bfloat16* g, std::size_t i) { return __bfloat162float(g[i]); }
template <>
__device__ float grad_value(const __half* g, std::size_t i) { return __half2float(g[i]); }

template <typename T>
__global__ void accumulate_kernel(float* __restrict__ acc, const T* __restrict__ g, std::size_t n, bool overwrite,
                                  float scale) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    acc[i] = overwrite ? scale * grad_value(g, i) : fmaf(scale, grad_value(g, i), acc[i]);  // as the CPU twin
  }
}

}  // namespace

// s.runs is a host array: its copy goes up on the stream (staged before
// cudaMemcpyAsync returns, pageable memory) and is freed after the kernel.
cudaError_t adam_step_compact(const detail::CompactStep& s, std::size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  detail::CompactStep d = s;
  const std::size_t run_bytes = s.run_count * sizeof(detail::DecayRun);
  cudaError_t err = cudaSuccess;
  if (run_bytes > 0) {
    void* d_runs = nullptr;
    err = cudaMallocAsync(&d_runs, run_bytes, stream);
    if (err != cudaSuccess) return err;
    d.runs = static_cast<const detail::DecayRun*>(d_runs);
    err = cudaMemcpyAsync(d_runs, s.runs, run_bytes, cudaMemcpyHostToDevice, stream);
  }
  static_assert(kThreads % 32 == 0, "Note [Tie bits across threads]: blocks of whole warps");
  if (err == cudaSuccess && s.int8_moments) {
    adam_compact_int8_kernel<<<grid_for(n), kThreads, 0, stream>>>(d, n);
    err = cudaGetLastError();
  } else if (err == cudaSuccess) {
    const std::size_t shift = s.remainder_master ? s.tie_bit_offset % 8 : 0;
    adam_compact_kernel<<<grid_for(n + shift), kThreads, 0, stream>>>(d, n);
    err = cudaGetLastError();
  }
  if (run_bytes > 0) {
    const cudaError_t freed = cudaFreeAsync(const_cast<detail::DecayRun*>(d.runs), stream);
    if (err == cudaSuccess) err = freed;
  }
  return err;
}

cudaError_t accumulate_grad(float* d_acc, const void* d_grad, int format, std::size_t n, bool overwrite, float scale,
                            cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (format) {
    case 0:
      accumulate_kernel<<<grid_for(n), kThreads, 0, stream>>>(d_acc, static_cast<const float*>(d_grad), n, overwrite, scale);
      break;
    case 1:
      accumulate_kernel<<<grid_for(n), kThreads, 0, stream>>>(d_acc, static_cast<const __nv_bfloat16*>(d_grad), n,
                                                              overwrite, scale);
      break;
    default:
      accumulate_kernel<<<grid_for(n), kThreads, 0, stream>>>(d_acc, static_cast<const __half*>(d_grad), n, overwrite,
                                                              scale);
      break;
  }
  return cudaGetLastError();
}

cudaError_t unscale(float* d_g, std::size_t n, float inv_scale, int* d_found_non_finite, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  unscale_kernel<<<grid_for(n), kThreads, 0, stream>>>(d_g, n, inv_scale, d_found_non_finite);
  return cudaGetLastError();
}

cudaError_t squared_norms(const Tensor* tensors, std::size_t count, double* d_out, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  // One upload: the chunk list, then each tensor's first chunk (count + 1 entries).
  std::vector<NormChunk> chunks;
  std::vector<unsigned long long> first;
  for (std::size_t t = 0; t < count; ++t) {
    first.push_back(chunks.size());
    for (std::size_t at = 0; at < tensors[t].numel; at += kNormChunk) {
      const std::size_t len = tensors[t].numel - at < kNormChunk ? tensors[t].numel - at : kNormChunk;
      chunks.push_back({tensors[t].data + at, len});
    }
  }
  first.push_back(chunks.size());
  const std::size_t chunk_bytes = chunks.size() * sizeof(NormChunk), first_bytes = first.size() * sizeof(first[0]);
  void* d_meta = nullptr;
  double* d_partials = nullptr;
  cudaError_t err = cudaMallocAsync(&d_meta, chunk_bytes + first_bytes, stream);
  if (err == cudaSuccess) err = cudaMallocAsync(reinterpret_cast<void**>(&d_partials), (chunks.size() + 1) * sizeof(double), stream);
  // Pageable sources: cudaMemcpyAsync has staged them when it returns, so the vectors may go.
  if (err == cudaSuccess && !chunks.empty()) err = cudaMemcpyAsync(d_meta, chunks.data(), chunk_bytes, cudaMemcpyHostToDevice, stream);
  auto* d_first = reinterpret_cast<unsigned long long*>(static_cast<char*>(d_meta) + chunk_bytes);
  if (err == cudaSuccess) err = cudaMemcpyAsync(d_first, first.data(), first_bytes, cudaMemcpyHostToDevice, stream);
  if (err == cudaSuccess && !chunks.empty()) {
    norm_partials_kernel<<<static_cast<unsigned>(chunks.size()), kThreads, 0, stream>>>(
        static_cast<const NormChunk*>(d_meta), d_partials);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) {
    norm_finish_kernel<<<static_cast<unsigned>((count + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        d_partials, d_first, count, d_out);
    err = cudaGetLastError();
  }
  if (d_partials != nullptr) cudaFreeAsync(d_partials, stream);
  if (d_meta != nullptr) cudaFreeAsync(d_meta, stream);
  return err;
}

cudaError_t adam_step(float* d_param, const float* d_grad, float* d_m, float* d_v, std::uint16_t* d_param16,
                      std::size_t n, const detail::AdamCoef& coef, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  adam_kernel<<<grid_for(n), kThreads, 0, stream>>>(d_param, d_grad, d_m, d_v,
                                                     reinterpret_cast<__nv_bfloat16*>(d_param16), n, coef);
  return cudaGetLastError();
}

}  // namespace tz::kernels::launch
