// Private to train/: where a GptTrainer computes when not on the CPU. The CPU
// GPT lives in gpt.cpp's GptTrainer::State; a CUDA engine gets a
// TrainerBackend from make_cuda_trainer (gpt_cuda.cpp; gpt_nocuda.cpp in
// builds without CUDA says Unavailable). GptTrainer checks batches and the
// engine's layout before calling in.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tierzero/train/gpt.h"

namespace tz::train::detail {

class TrainerBackend {
 public:
  virtual ~TrainerBackend() = default;
  // GptTrainer::train_micro_batch and eval_loss on checked batches.
  virtual Expected<double> train_micro_batch(const TokenBatch& batch) = 0;
  virtual Expected<double> eval_loss(const std::vector<TokenBatch>& batches) = 0;
  virtual std::string describe() const = 0;
};

Expected<std::unique_ptr<TrainerBackend>> make_cuda_trainer(ZeroEngine& engine, const GptConfig& cfg,
                                                            const CudaOptions& options);

}  // namespace tz::train::detail
