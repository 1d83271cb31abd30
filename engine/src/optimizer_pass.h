// OptimizerPass: one optimizer step over every block's shard, wherever its
// states live. Two variants behind one interface:
//
//   CPU: sub-groups of blocks rotate through kStagingSets pinned staging sets
//        (Note [Optimizer pipeline]): the NVMe-resident states of the next
//        sub-group are read while this one steps in cpu_adam and the last
//        one's new states and 16-bit parameters are written back.
//   GPU: with every state class on the GPU, the Adam kernel steps each shard
//        in place with its 16-bit copy-out (Note [GPU optimizer]).
//
// The engine decides whether the step runs at all (the norm, an fp16
// overflow, clipping: optimizer_step.cpp) and hands the pass the
// hyperparameters and the gradient scale. Each state class on NVMe is read
// once and written once per step (gradients only read), so the bytes moved
// are the planner's count.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "trace.h"
#include "tierzero/cpu_adam.h"
#include "tierzero/engine/model.h"
#include "tierzero/offload.h"

namespace tz::detail {

struct OptimizerPassDeps {
  Device* device = nullptr;
  Stream* stream = nullptr;              // copies of the new parameters to the GPU; the GPU variant's kernels
  MemoryPool* device_pool = nullptr;
  MemoryPool* host_pool = nullptr;       // staging
  TieredStore* param16 = nullptr;
  TieredStore* grad = nullptr;           // the fp32 accumulated gradient
  TieredStore* master = nullptr;
  TieredStore* exp_avg = nullptr;        // nullptr for Adagrad
  TieredStore* exp_avg_sq = nullptr;     // nullptr for Lion
  cpu_adam::CpuOptimizer* cpu_opt = nullptr;
  const ModelLayout* layout = nullptr;
  DType param_type = DType::kBf16;
  MasterFormat master_format = MasterFormat::kFp32;  // remainder: the CPU variant only (creation refuses the GPU one)
  DType moment_dtype = DType::kFp32;                 // fp32 | bf16 (tierzero.states.moments); bf16: CPU variant only
  std::uint64_t sub_group_size = 1;      // zero_optimization.sub_group_size: elements stepped together (CPU)
  Timeline* timeline = nullptr;
  // Per block, the weight-decay segments of this rank's shard (Note [Weight
  // decay per parameter] in optimizer_step.cpp); a block's empty table, or
  // none: Hyper::weight_decay for all of it.
  const std::vector<std::vector<cpu_adam::WeightDecaySegment>>* weight_decay_segments = nullptr;
};

class OptimizerPass {
 public:
  // The GPU variant where on_gpu (every state class on the GPU, CUDA), else the CPU one.
  static std::unique_ptr<OptimizerPass> make(const OptimizerPassDeps& deps, bool on_gpu);
  virtual ~OptimizerPass() = default;

  // One step of every block: `step` is the optimizer step being taken (from
  // 1), grad_scale multiplies the accumulated gradient (clipping over the
  // loss scale). Returns when every new state and parameter is in its tier.
  virtual Status run(const cpu_adam::Hyper& h, std::int64_t step, double grad_scale) = 0;
  // How many sub-groups the CPU variant steps in (1 for the GPU one).
  virtual std::size_t sub_groups() const = 0;
};

}  // namespace tz::detail
