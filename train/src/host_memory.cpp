#include "tierzero/train/host_memory.h"

// Note [Peak RSS estimate]
// tierzero-train's resident memory at its peak on the CPU backend is the sum
// of six parts that do not overlap:
//   - the model states the plan puts in host memory: the CPU tier's, and on
//     the Host backend the device tier's (device memory is host memory there);
//   - the plan's buffers in those tiers: NVMe staging, the gather window, the
//     gradients in flight (planner.cpp's add_gpu_extras/add_cpu_extras; the
//     engine keeps its pools within them, ZeroEngine.ThePoolsStayWithinThePlan);
//   - the CPU GPT's activations and block copies, GptConfig::activation_bytes,
//     which are exact for one micro-batch and held through its backward;
//   - evaluation's buffers, GptConfig::evaluation_bytes, held beside those
//     while eval_loss runs (a one-layer workspace, the batches' residual
//     streams, a gathered master), when the run evaluates;
//   - the corpus, read whole into memory;
//   - a runtime baseline for everything else: the code and data of the
//     program and the libraries the CPU path maps, thread stacks, the
//     allocator's arenas. It is measured, not derived, on the smallest run
//     (bench/RESULTS.md, "Peak RSS against tierzero-estimate"), and checked on
//     larger ones: it does not grow with the model.
// NVMe-resident states add nothing to RSS (O_DIRECT bypasses the page cache)
// beyond their staging. On CUDA the activations and the device tier are GPU
// memory; the CUDA runtime's own host memory is not modelled.

namespace tz::train {

HostMemoryEstimate estimate_host_memory(const GptConfig& cfg, const Plan& plan, BackendKind backend,
                                        std::uint64_t corpus_bytes, int eval_batches) {
  HostMemoryEstimate m;
  const auto in_host = [backend](Tier t) { return t == Tier::kCpu || (t == Tier::kGpu && backend == BackendKind::kHost); };
  std::uint64_t tier_bytes = 0;
  for (Tier t : {Tier::kGpu, Tier::kCpu}) {
    if (in_host(t)) tier_bytes += plan.usage_of(t).per_rank_bytes;
  }
  for (StateClass s : {StateClass::kParam16, StateClass::kGrad, StateClass::kMaster, StateClass::kMoments}) {
    if (in_host(plan.tier_of(s))) m.state_bytes += plan.bytes_of(s);
  }
  m.buffer_bytes = tier_bytes - m.state_bytes;
  m.activation_bytes = backend == BackendKind::kHost ? cfg.activation_bytes() : 0;
  m.evaluation_bytes = backend == BackendKind::kHost ? cfg.evaluation_bytes(eval_batches) : 0;
  m.corpus_bytes = corpus_bytes;
  return m;
}

}  // namespace tz::train
