// The host memory one rank of tierzero-train holds at its peak on the CPU
// backend, predicted from the model, the placement plan and the corpus:
// what tierzero-estimate prints for a GPT (--hidden ...) and compares with a
// measured peak RSS (Note [Peak RSS estimate] in train/src/host_memory.cpp).
//
//   const tz::train::HostMemoryEstimate m =
//       tz::train::estimate_host_memory(cfg, plan, tz::BackendKind::kHost, corpus_bytes, /*eval_batches=*/4);
//   fmt::print("predicted peak RSS {}\n", tz::format_bytes(m.total_bytes()));
#pragma once

#include <cstdint>

#include "tierzero/offload.h"
#include "tierzero/train/gpt.h"

namespace tz::train {

// The program before it builds anything: its code, the libraries the CPU path
// maps, oneTBB's and the engine's threads, the allocator's own overhead.
// Measured, not derived (Note [Peak RSS estimate]).
inline constexpr std::uint64_t kRuntimeBaselineBytes = 16ULL << 20;

struct HostMemoryEstimate {
  std::uint64_t state_bytes = 0;       // model states in host memory (one rank)
  std::uint64_t buffer_bytes = 0;      // the plan's staging, gather and gradient buffers in host memory
  std::uint64_t activation_bytes = 0;  // GptConfig::activation_bytes on the CPU backend; 0 on CUDA (GPU memory)
  std::uint64_t evaluation_bytes = 0;  // GptConfig::evaluation_bytes on the CPU backend, when the run evaluates
  std::uint64_t corpus_bytes = 0;      // the training text, held whole
  std::uint64_t runtime_bytes = kRuntimeBaselineBytes;
  std::uint64_t total_bytes() const {
    return state_bytes + buffer_bytes + activation_bytes + evaluation_bytes + corpus_bytes + runtime_bytes;
  }
};

// On the Host backend the plan's device tier is host memory too (its pools
// are malloc'd); on CUDA only the CPU tier is, and the activations live on
// the GPU. NVMe-resident states count only through their staging buffers.
// `eval_batches`: tierzero-train's --eval-batches, 0 for a run that never
// evaluates (--eval-every 0).
HostMemoryEstimate estimate_host_memory(const GptConfig& cfg, const Plan& plan, BackendKind backend,
                                        std::uint64_t corpus_bytes, int eval_batches);

}  // namespace tz::train
