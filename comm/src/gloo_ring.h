// Reduce-scatter for the Gloo backend, as a ring over Gloo's unbound buffers.
// See Note [Ring reduce-scatter] in the .cpp for why and how.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>

#include "reduce.h"

namespace gloo {
class Context;
}  // namespace gloo

namespace tz::comm_detail {

// Runs `call`, a Gloo call whose buffers live in the caller's frame; when it
// throws, closes `context`'s connections before the exception (and with it
// the buffers) leaves: Note [Buffers outlive the failure] in gloo.cpp.
void close_on_failure(gloo::Context& context, const std::function<void()>& call);

class RingReduceScatter {
 public:
  RingReduceScatter(std::shared_ptr<gloo::Context> context, std::chrono::milliseconds timeout);

  // recv (count elements) = reduce over ranks of send[rank * count, (rank + 1) * count),
  // send being size * count elements. recv may be send + rank * count. Not
  // thread-safe (the communicator serialises calls). Throws what Gloo throws.
  void run(const std::byte* send, std::byte* recv, std::size_t count, std::size_t element_bytes, ReduceFn reduce);

 private:
  struct Step {
    const std::byte* partial;  // (block_bytes,) the running reduction this rank passes on
    std::byte* incoming;       // (block_bytes,) where the left neighbour's arrives
    const std::byte* own;      // (block_bytes,) this rank's input for the arriving block
    std::byte* result;         // (block_bytes,) incoming op own goes here (may be incoming)
  };
  void step(const Step& s, std::size_t block_bytes, std::size_t element_bytes, ReduceFn reduce);
  std::byte* scratch(std::size_t bytes);

  std::shared_ptr<gloo::Context> context_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<std::byte[]> scratch_;  // (2 * block_bytes,) partial sums, kept between calls
  std::size_t scratch_bytes_ = 0;
};

}  // namespace tz::comm_detail
