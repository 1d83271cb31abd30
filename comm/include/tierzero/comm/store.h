// RendezvousStore: a key-value store that every rank of a job reaches over
// the network, through which ranks on different machines meet. The
// communicators put in it what the ranks must exchange once (each rank's Gloo
// pair addresses and host, NCCL's unique id) and then talk directly.
//
// tierzero does not serve one itself: the launcher's is used. Python ranks
// under torchrun hand the engine torch's c10d store (bindings/, see
// docs/engine.md "Ranks on several machines"); the C++ programs meet through
// MPI under mpirun, and through the file rendezvous otherwise.
//
//   std::shared_ptr<tz::RendezvousStore> store = ...;   // e.g. torch's TCPStore
//   auto comm = tz::create_communicator({.ranks = ranks, .store = store});
//
// Every rank must hand create_communicator a store that reaches the same
// server. A store may be used for several communicators one after another;
// each takes a fresh namespace in it (Note [Store rendezvous] in
// comm/src/store_rendezvous.cpp).
//
// Threads: a store is used by one thread at a time, the one creating the
// communicator. Errors: IoError (the server is unreachable) or Timeout
// naming the key, and the server's address as describe() gives it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "tierzero/common.h"

namespace tz {

class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;

  // Sets `key` to `value` for every rank to read.
  virtual Status set(const std::string& key, const std::vector<char>& value) = 0;
  // Waits up to `timeout` for `key` to be set, then returns its value.
  // Timeout when it was not set in time (the message names the key).
  virtual Expected<std::vector<char>> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Adds `delta` to the integer at `key` (0 when unset) and returns the sum.
  virtual Expected<std::int64_t> add(const std::string& key, std::int64_t delta) = 0;
  // Removes `key`; a key that is not there is not an error.
  virtual Status erase(const std::string& key) = 0;
  // Where the store is, for the log and for errors: "torch TCPStore at 10.0.0.1:29500".
  virtual std::string describe() const = 0;
};

}  // namespace tz
