// Where the optimizer's workers run: the CPUs of one NUMA node, bound with
// hwloc when a oneTBB worker enters the optimizer's arena and unbound when it
// leaves (TBB's workers are shared with other arenas).
#pragma once

#include <hwloc.h>

#include <memory>
#include <string>

#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include "tierzero/common.h"

namespace tz::cpu_adam::detail {

struct HwlocTopologyDeleter {
  void operator()(hwloc_topology* topology) const { hwloc_topology_destroy(topology); }
};
struct HwlocBitmapDeleter {
  void operator()(hwloc_bitmap_s* bitmap) const { hwloc_bitmap_free(bitmap); }
};
using HwlocTopology = std::unique_ptr<hwloc_topology, HwlocTopologyDeleter>;
using HwlocBitmap = std::unique_ptr<hwloc_bitmap_s, HwlocBitmapDeleter>;

class Pinning {
 public:
  // numa_node: Options::numa_node (-1: the node of the first CPU). Machines
  // with one node, and machines where hwloc fails, get no pinning (logged at
  // debug). A node that does not exist, or has no CPUs, is an InvalidArgument.
  static Expected<std::unique_ptr<Pinning>> create(int numa_node);

  bool pins() const { return cpuset_ != nullptr; }
  int node() const { return node_; }          // -1 when not pinning
  int cpu_count() const { return cpu_count_; } // the CPUs Options::threads = 0 uses
  const std::string& description() const { return description_; }

  // Binds the calling thread to the node's CPUs, keeping its previous binding
  // for restore_current_thread(). Failures are logged once and ignored.
  void bind_current_thread() const;
  void restore_current_thread() const;

 private:
  Pinning() = default;

  HwlocTopology topology_;
  HwlocBitmap cpuset_;  // null: no pinning
  int node_ = -1;
  int cpu_count_ = 1;
  std::string description_;
};

// Pins each worker of `arena` while it is in the arena. The calling thread of
// arena.execute() is the user's and is left alone.
class PinningObserver final : public tbb::task_scheduler_observer {
 public:
  PinningObserver(tbb::task_arena& arena, const Pinning& pinning);
  ~PinningObserver() override;
  PinningObserver(const PinningObserver&) = delete;
  PinningObserver& operator=(const PinningObserver&) = delete;

  void on_scheduler_entry(bool is_worker) override;
  void on_scheduler_exit(bool is_worker) override;

 private:
  const Pinning& pinning_;
};

}  // namespace tz::cpu_adam::detail
