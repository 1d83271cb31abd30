#include "pinning.h"

#include <cerrno>
#include <thread>
#include <vector>

namespace tz::cpu_adam::detail {
namespace {

int machine_cpus() { return std::max(1, static_cast<int>(std::thread::hardware_concurrency())); }

// The previous binding of this thread while it is pinned by us.
thread_local HwlocBitmap t_saved_binding;

std::string node_list(hwloc_topology_t topology) {
  std::string out;
  hwloc_obj_t node = nullptr;
  while ((node = hwloc_get_next_obj_by_type(topology, HWLOC_OBJ_NUMANODE, node)) != nullptr) {
    out += (out.empty() ? "" : ", ") + std::to_string(node->os_index);
  }
  return out;
}

hwloc_obj_t find_node(hwloc_topology_t topology, int numa_node) {
  hwloc_obj_t node = nullptr;
  while ((node = hwloc_get_next_obj_by_type(topology, HWLOC_OBJ_NUMANODE, node)) != nullptr) {
    if (numa_node >= 0 && node->os_index == static_cast<unsigned>(numa_node)) return node;
    if (numa_node < 0 && node->cpuset != nullptr && !hwloc_bitmap_iszero(node->cpuset)) return node;
  }
  return nullptr;
}

}  // namespace

Expected<std::unique_ptr<Pinning>> Pinning::create(int numa_node) {
  std::unique_ptr<Pinning> p(new Pinning());
  p->cpu_count_ = machine_cpus();
  hwloc_topology_t raw = nullptr;
  if (hwloc_topology_init(&raw) != 0) {
    p->description_ = "not pinned: hwloc_topology_init failed";
    TZ_LOG_DEBUG("cpu_adam", "workers {}", p->description_);
    return p;
  }
  p->topology_.reset(raw);
  if (hwloc_topology_load(raw) != 0) {
    p->description_ = fmt::format("not pinned: hwloc_topology_load failed (errno {})", errno);
    TZ_LOG_DEBUG("cpu_adam", "workers {}", p->description_);
    return p;
  }
  const int nodes = hwloc_get_nbobjs_by_type(raw, HWLOC_OBJ_NUMANODE);
  const hwloc_obj_t node = find_node(raw, numa_node);
  if (numa_node >= 0 && node == nullptr) {
    return invalid_argument("Options::numa_node = {} does not exist (NUMA nodes: {})", numa_node, node_list(raw));
  }
  if (numa_node >= 0 && (node->cpuset == nullptr || hwloc_bitmap_iszero(node->cpuset))) {
    return invalid_argument("Options::numa_node = {} has no CPUs to run on", numa_node);
  }
  const int pus = hwloc_get_nbobjs_by_type(raw, HWLOC_OBJ_PU);
  if (pus > 0) p->cpu_count_ = pus;
  if (nodes <= 1 || node == nullptr) {
    p->description_ = fmt::format("not pinned: {} NUMA node(s)", nodes);
    TZ_LOG_DEBUG("cpu_adam", "workers {}", p->description_);
    return p;
  }
  p->cpuset_.reset(hwloc_bitmap_dup(node->cpuset));
  if (p->cpuset_ == nullptr) return out_of_memory("hwloc_bitmap_dup of NUMA node {}'s cpuset", node->os_index);
  p->node_ = static_cast<int>(node->os_index);
  p->cpu_count_ = std::max(1, hwloc_bitmap_weight(node->cpuset));
  p->description_ = fmt::format("pinned to NUMA node {} ({} CPUs)", p->node_, p->cpu_count_);
  return p;
}

void Pinning::bind_current_thread() const {
  if (!pins()) return;
  t_saved_binding.reset(hwloc_bitmap_alloc());
  if (t_saved_binding && hwloc_get_cpubind(topology_.get(), t_saved_binding.get(), HWLOC_CPUBIND_THREAD) != 0) {
    t_saved_binding.reset();
  }
  if (hwloc_set_cpubind(topology_.get(), cpuset_.get(), HWLOC_CPUBIND_THREAD) != 0) {
    const int err = errno;
    TZ_LOG_ONCE_WARN("cpu_adam", "pinning a worker to NUMA node {} failed (errno {}); running unpinned", node_, err);
    t_saved_binding.reset();
  }
}

void Pinning::restore_current_thread() const {
  if (!pins() || !t_saved_binding) return;
  (void)hwloc_set_cpubind(topology_.get(), t_saved_binding.get(), HWLOC_CPUBIND_THREAD);
  t_saved_binding.reset();
}

PinningObserver::PinningObserver(tbb::task_arena& arena, const Pinning& pinning)
    : tbb::task_scheduler_observer(arena), pinning_(pinning) {
  observe(true);
}

// Stop observing before pinning_ can go away; TBB waits for running callbacks.
PinningObserver::~PinningObserver() { observe(false); }

void PinningObserver::on_scheduler_entry(bool is_worker) {
  if (is_worker) pinning_.bind_current_thread();
}

void PinningObserver::on_scheduler_exit(bool is_worker) {
  if (is_worker) pinning_.restore_current_thread();
}

}  // namespace tz::cpu_adam::detail
