// The CUDA GPT's entry points in builds without CUDA (TIERZERO_CUDA=OFF):
// each says so with an Unavailable Status.
#include "trainer_backend.h"

namespace tz::train {

namespace detail {
Expected<std::unique_ptr<TrainerBackend>> make_cuda_trainer(ZeroEngine& /*engine*/, const GptConfig& /*cfg*/,
                                                            const CudaOptions& /*options*/) {
  return unavailable("the engine computes on CUDA, but this tierzero was built without CUDA (TIERZERO_CUDA=OFF), "
                     "so the GPT has no CUDA implementation");
}
}  // namespace detail

bool cuda_gpt_built() { return false; }

Expected<double> forward_backward_cuda(const GptConfig& /*cfg*/, const ModelLayout& /*layout*/,
                                       const std::vector<std::vector<float>>& /*weights*/, const TokenBatch& /*batch*/,
                                       double /*loss_scale*/, std::vector<std::vector<float>>* /*grads*/,
                                       const CudaOptions& /*options*/) {
  return unavailable("forward_backward_cuda: this tierzero was built without CUDA (TIERZERO_CUDA=OFF)");
}

}  // namespace tz::train
