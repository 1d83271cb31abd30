// A small built-in workload: a stack of fully connected layers trained with a
// mean-squared-error loss on synthetic data, on the CPU. It drives ZeroEngine
// the way a real model does (fetch, compute, release; backward in reverse with
// reduce_grads; step), and comes with an in-memory reference that computes
// the same training run with every state in memory and a plain Adam, so the
// engine's offloaded result can be checked against it.
//
//   layer l (one block, "layer<l>"): w (hidden x hidden), b (hidden)
//   h_{l+1} = tanh(h_l w^T + b) for l < layers - 1, linear for the last
//   loss = sum over the batch of |h_L - target|^2 / (2 batch)
//
// Data: every (rank, micro-batch, step) has its own deterministic batch, so a
// run on N ranks and the reference (which computes all N) see the same data.
// Arithmetic: fp32, in a fixed order; parameters are used as their 16-bit
// values (as the engine stores them).
//
//   tz::mlp::MlpConfig cfg{.layers = 4, .hidden = 256, .batch = 8};
//   TZ_ASSIGN_OR_RETURN(auto engine, tz::ZeroEngine::create(opts, tz::mlp::model(cfg), tz::mlp::init(cfg)));
//   for (int step = 0; step < steps; ++step)
//     for (int micro = 0; micro < gas; ++micro) {
//       TZ_ASSIGN_OR_RETURN(double loss, tz::mlp::train_micro_batch(*engine, cfg, tz::mlp::make_batch(cfg, rank, micro, step)));
//       TZ_ASSIGN_OR_RETURN(tz::StepReport r, engine->step());
//     }
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "tierzero/engine/reference.h"
#include "tierzero/engine/zero.h"

namespace tz::mlp {

struct MlpConfig {
  int layers = 4;
  int hidden = 128;
  int batch = 8;                  // rows per micro-batch per rank
  std::uint64_t seed = 1234;
};

std::vector<BlockSpec> model(const MlpConfig& cfg);
ParamInit init(const MlpConfig& cfg);  // uniform(-1/sqrt(hidden), 1/sqrt(hidden)); b = 0

struct Batch {
  std::vector<float> x;           // (batch, hidden)
  std::vector<float> target;      // (batch, hidden)
};
Batch make_batch(const MlpConfig& cfg, int rank, int micro, std::int64_t step);

// Called around each block's compute (forward and backward), e.g. to add a
// simulated compute time in benchmarks. May be empty.
using ComputeHook = std::function<void(std::size_t block, bool backward)>;

// One micro-batch through the engine: forward, loss, backward with
// reduce_grads. The loss is multiplied by engine.loss_scale() before backward
// (fp16); the returned loss is unscaled. `inject_inf`: puts an inf into the
// first gradient of the last block, or of block inf_block when that is >= 0
// (to test overflow handling).
Expected<double> train_micro_batch(ZeroEngine& engine, const MlpConfig& cfg, const Batch& batch,
                                   const ComputeHook& hook = {}, bool inject_inf = false, int inf_block = -1);

// The same training with every state in memory: fp32 master weights, 16-bit
// parameters rounded from them, gradients averaged over ranks and
// micro-batches, global-norm clipping, and a plain Adam/AdamW in double
// (torch.optim semantics).
class Reference {
 public:
  // grad_type: the engine's gradient type (ZeroOptions::grad_type; default
  // the parameter type), whose rounding the reference repeats.
  Reference(const MlpConfig& cfg, const Config& config, int world_size, std::optional<DType> grad_type = {});
  // One optimizer step over world_size ranks x gradient_accumulation_steps
  // micro-batches of step `step` (0-based). Returns the mean loss.
  double train_step(std::int64_t step);
  // Block b's fp32 master weights in the engine's layout (whole, padded).
  std::vector<float> master(std::size_t block) const { return states_.master(block); }
  const ModelLayout& layout() const { return states_.layout(); }
  void set_learning_rate(double lr) { states_.set_learning_rate(lr); }

 private:
  MlpConfig cfg_;
  int world_ = 1;
  DType grad_type_ = DType::kBf16;
  ReferenceStates states_;
};

}  // namespace tz::mlp
