// tierzero._core.Engine: the ZeroEngine (tierzero/engine/zero.h) for Python.
// tierzero.Engine and tierzero.torch build on it.
//
// Note [Engine calls and the GIL]
// Every call into the ZeroEngine runs with the GIL released (fetch waits for
// NVMe reads and all-gathers, step runs the optimizer) and under the engine's
// own mutex: the engine is called from one thread at a time, and gathered
// blocks are released from wherever Python drops their last reference (the
// autograd engine's threads among them). A thread holding the mutex never
// takes the GIL, so the two cannot deadlock.
//
// Note [Gathered block lifetime]
// fetch() returns a GatheredBlock object that owns the engine's GatheredBlock.
// Its `data` and `param(i)` arrays (DLPack, zero-copy views of the gathered
// device buffer) name that object as their owner: a torch tensor made from
// them with torch.from_dlpack keeps it alive, and the engine releases the
// buffer (back to its pool, to be refilled by a prefetch) only when the last
// view of it is gone. No view can outlive the memory it points at. Each
// object also holds the engine core, so an Engine dropped while views live
// stays alive until they go. There is no explicit release(): one would leave
// views dangling. On CUDA the caller's kernels reading the views may still be
// queued when the last view goes: fetch(stream=) names the stream they run
// on, and the release waits for it (Note [Stream-ordered release] in
// tierzero/engine/zero.h).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "arrays.h"
#include "errors.h"
#include "store.h"
#include "tierzero/engine.h"
#include "tierzero/kernels.h"

namespace tzpy {
namespace {

constexpr int kDLCPU = 1;
constexpr int kDLCUDA = 2;

struct CoreHandle {
  std::mutex mu;                            // Note [Engine calls and the GIL]
  std::unique_ptr<tz::Device> device;       // declared first: destroyed last
  std::unique_ptr<tz::Communicator> comm;
  std::unique_ptr<tz::ZeroEngine> engine;
  std::unique_ptr<tz::Stream> copy_stream;  // gradient copies into GradBlocks
  int dl_device_type = kDLCPU;
  int dl_device_id = 0;
};

// Runs fn under the engine mutex with the GIL released; raises its Status.
template <typename Fn>
auto locked(CoreHandle& core, Fn&& fn) {
  using R = decltype(fn());
  std::optional<R> result;
  {
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(core.mu);
    result.emplace(fn());
  }
  if constexpr (std::is_same_v<R, tz::Status>) {
    check(*result);
  } else {
    return value_or_raise(std::move(*result));
  }
}

class PyGathered {
 public:
  // `readers`: the caller's stream its kernels read the block on, where the
  // release must wait for them (Note [Stream-ordered release] in
  // tierzero/engine/zero.h); none: they are done when the last view goes.
  PyGathered(std::shared_ptr<CoreHandle> core, tz::GatheredBlock block, std::optional<void*> readers)
      : core_(std::move(core)), block_(std::move(block)), readers_(readers) {}
  PyGathered(const PyGathered&) = delete;
  ~PyGathered() {
    // Called by Python's deallocator with the GIL held (Note [Engine calls and the GIL]).
    if (!block_.valid()) return;
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
      nb::gil_scoped_release release;
      give_back();
    } else {
      give_back();
    }
  }

  std::size_t index() const { return block_.block(); }
  const tz::BlockLayout& layout() const { return core_->engine->layout().blocks[block_.block()]; }

  // A view of [offset, offset + numel) with `shape`, owned by this object (Note [Gathered block lifetime]).
  ExportArray view(std::uint64_t offset, const std::vector<std::int64_t>& shape) {
    std::vector<std::size_t> dims(shape.begin(), shape.end());
    char* base = static_cast<char*>(block_.data()) + offset * tz::dtype_bytes(block_.type());
    return ExportArray(base, dims.size(), dims.data(), nb::find(this), nullptr, dlpack_dtype(block_.type()),
                    core_->dl_device_type, core_->dl_device_id);
  }
  ExportArray data() { return view(0, {static_cast<std::int64_t>(layout().whole_numel)}); }
  std::optional<std::int64_t> readers() const {
    if (!readers_) return std::nullopt;
    return static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(*readers_));
  }
  ExportArray param(std::size_t i) {
    const tz::BlockLayout& b = layout();
    if (i >= b.params.size()) {
      raise_status(tz::invalid_argument("GatheredBlock.param({}): block '{}' has {} parameters", i, b.name,
                                        b.params.size()));
    }
    return view(b.params[i].offset, b.params[i].shape);
  }

 private:
  // A destructor cannot raise: a failed release is logged, and the engine's
  // next call fails with it.
  void give_back() {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (!readers_) {
      block_ = tz::GatheredBlock();
      return;
    }
    const tz::Status s = block_.release_after_native(*readers_);
    if (!s.ok()) TZ_LOG_ERROR("python", "GatheredBlock: {}", s.to_string());
  }

  std::shared_ptr<CoreHandle> core_;
  tz::GatheredBlock block_;
  std::optional<void*> readers_;
};

nb::dict report_dict(const tz::StepReport& r) {
  nb::dict d;
  d["stepped"] = r.stepped;
  d["overflow"] = r.overflow;
  d["step"] = r.step;
  d["grad_norm"] = r.grad_norm;
  d["clip_coef"] = r.clip_coef;
  d["lr"] = r.lr;
  d["loss_scale"] = r.loss_scale;
  d["optimizer_seconds"] = r.optimizer_seconds;
  d["ahead_blocks"] = r.ahead_blocks;  // Note [Stepping under backward]
  d["ahead_redone"] = r.ahead_redone;
  d["ahead_seconds"] = r.ahead_seconds;
  d["ahead_hidden_seconds"] = r.ahead_hidden_seconds;
  d["ahead_off"] = r.ahead_off;
  d["ahead_redone_read_bytes"] = r.ahead_redone_read_bytes;  // Note [What a redo costs]
  d["ahead_redone_write_bytes"] = r.ahead_redone_write_bytes;
  d["ahead_redone_seconds"] = r.ahead_redone_seconds;
  d["ahead_redo_reason"] = r.ahead_redo_reason;
  d["kept_param_blocks"] = r.kept_param_blocks;  // Note [The step keeps backward's parameter shards]
  d["kept_param_bytes"] = r.kept_param_bytes;
  d["reread_param_blocks"] = r.reread_param_blocks;
  d["next_fetches_under_step"] = r.next_fetches_under_step;  // Note [The next forward's fetches under the optimizer]
  d["nvme_read_bytes"] = r.nvme_read_bytes;
  d["nvme_write_bytes"] = r.nvme_write_bytes;
  d["nvme_read_busy_seconds"] = r.nvme_read_busy_seconds;
  d["nvme_write_busy_seconds"] = r.nvme_write_busy_seconds;
  d["h2d_bytes"] = r.h2d_bytes;
  d["d2h_bytes"] = r.d2h_bytes;
  d["grad_window_blocks"] = r.grad_window_blocks;
  d["gather_bytes"] = r.gather_bytes;
  d["host_waits"] = r.host_waits;
  d["blocks_reduced"] = r.blocks_reduced;
  d["wait_nvme_seconds"] = r.wait_nvme_seconds;
  d["wait_h2d_seconds"] = r.wait_h2d_seconds;
  d["wait_gather_seconds"] = r.wait_gather_seconds;
  d["fetches"] = r.fetches;
  d["prefetched"] = r.prefetched;
  d["peak_gpu_bytes"] = r.peak_gpu_bytes;
  d["peak_cpu_bytes"] = r.peak_cpu_bytes;
  d["peak_nvme_bytes"] = r.peak_nvme_bytes;
  d["gpu_budget_bytes"] = r.gpu_budget_bytes;
  d["cpu_budget_bytes"] = r.cpu_budget_bytes;
  d["nvme_capacity_bytes"] = r.nvme_capacity_bytes;
  return d;
}

nb::list layout_list(const tz::ModelLayout& layout) {
  nb::list blocks;
  for (const tz::BlockLayout& b : layout.blocks) {
    nb::dict d;
    d["name"] = b.name;
    nb::list params;
    for (const tz::ParamLayout& p : b.params) {
      nb::dict pd;
      pd["name"] = p.name;
      pd["shape"] = nb::tuple(nb::cast(p.shape));
      pd["offset"] = p.offset;
      pd["numel"] = p.numel;
      params.append(pd);
    }
    d["params"] = params;
    d["used_numel"] = b.used_numel;
    d["shard_numel"] = b.shard_numel;
    d["whole_numel"] = b.whole_numel;
    d["persistent"] = b.persistent;
    blocks.append(d);
  }
  return blocks;
}

using BlockList = std::vector<std::pair<std::string, std::vector<std::pair<std::string, std::vector<std::int64_t>>>>>;

// The initial values: per block, per parameter, an fp32 cpu array of the
// parameter's numel, or None for zeros. Checked and captured as pointers
// under the GIL; the engine copies them during create() (GIL released), while
// the caller's arrays are still referenced by the call's arguments.
using InitArrays = std::vector<std::vector<std::optional<InArray>>>;

std::vector<std::vector<const float*>> init_pointers(const BlockList& blocks, const InitArrays& init) {
  if (!init.empty() && init.size() != blocks.size()) {
    raise_status(tz::invalid_argument("Engine(): 'init' has {} blocks; 'blocks' has {}", init.size(), blocks.size()));
  }
  std::vector<std::vector<const float*>> out(blocks.size());
  const ArraySpec spec{{DType::kFp32}};
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    const auto& params = blocks[b].second;
    out[b].assign(params.size(), nullptr);
    if (init.empty()) continue;
    if (init[b].size() != params.size()) {
      raise_status(tz::invalid_argument("Engine(): init[{}] has {} arrays; block '{}' has {} parameters", b,
                                        init[b].size(), blocks[b].first, params.size()));
    }
    for (std::size_t p = 0; p < params.size(); ++p) {
      if (!init[b][p]) continue;
      const std::string arg = fmt::format("init[{}][{}]", b, p);
      const ArrayInfo a = check(*init[b][p], spec, "Engine()", arg);
      std::uint64_t numel = 1;
      for (std::int64_t d : params[p].second) numel *= static_cast<std::uint64_t>(std::max<std::int64_t>(d, 0));
      if (a.numel != numel) {
        raise_status(tz::invalid_argument("Engine(): argument '{}' ({}.{}) has {} elements; the parameter has {}", arg,
                                          blocks[b].first, params[p].first, a.numel, numel));
      }
      out[b][p] = static_cast<const float*>(a.data);
    }
  }
  return out;
}

tz::Config load(const std::optional<std::string>& path, const std::optional<std::string>& json) {
  if (path.has_value() == json.has_value()) {
    raise_status(tz::invalid_argument("Engine(): pass exactly one of config_path and config_json"));
  }
  return path ? value_or_raise(tz::load_config(*path)) : value_or_raise(tz::parse_config(*json, "<config dict>"));
}

// Note [Initial values] (tierzero/engine/zero.h), by the names Python passes.
tz::InitialValues initial_values(const std::string& name, const InitArrays& init) {
  if (name == "rank0") return tz::InitialValues::kRankZero;
  if (name == "same") return tz::InitialValues::kSameOnEveryRank;
  if (name == "later") {
    if (!init.empty()) {
      raise_status(tz::invalid_argument("Engine(): initial_values='later' writes no initial values, and 'init' gives "
                                        "some: set each block with set_master(), or pass initial_values='rank0'"));
    }
    return tz::InitialValues::kSetLater;
  }
  raise_status(tz::invalid_argument("Engine(): initial_values='{}' is not one of 'rank0' (rank 0's init on every "
                                    "rank), 'same' (every rank's init is the same) or 'later' (none: set_master "
                                    "sets each block)", name));
}

tz::Status make_core(CoreHandle& core, const tz::Config& config, const BlockList& blocks,
                     const std::vector<std::vector<const float*>>& init, tz::InitialValues from,
                     std::shared_ptr<tz::RendezvousStore> store, std::chrono::milliseconds timeout) {
  TZ_ASSIGN_OR_RETURN(tz::RankInfo ranks, tz::rank_info_from_env());
  TZ_ASSIGN_OR_RETURN(core.device, tz::create_device({.backend = config.backend, .ordinal = ranks.local_rank}));
  // Note [Python store and the GIL] (bindings/store.h) for `store`.
  TZ_ASSIGN_OR_RETURN(core.comm, tz::create_communicator({.ranks = ranks,
                                                          .timeout = timeout,
                                                          .store = std::move(store),
                                                          .device = core.device.get()}));
  std::vector<tz::BlockSpec> model;
  for (const auto& [name, params] : blocks) {
    tz::BlockSpec spec{name, {}};
    for (const auto& [pname, shape] : params) spec.params.push_back({pname, shape});
    model.push_back(std::move(spec));
  }
  const tz::ParamInit fill = [&init](std::size_t b, std::size_t p, float* out, std::uint64_t numel) {
    if (init[b][p] != nullptr) {
      std::copy(init[b][p], init[b][p] + numel, out);
    } else {
      std::fill(out, out + numel, 0.0F);
    }
  };
  TZ_ASSIGN_OR_RETURN(core.engine,
                      tz::ZeroEngine::create({.config = config, .comm = core.comm.get(), .device = core.device.get(),
                                              .initial_values = from},
                                             model, from == tz::InitialValues::kSetLater ? tz::ParamInit() : fill));
  TZ_ASSIGN_OR_RETURN(core.copy_stream, core.device->create_stream());
  if (core.device->kind() == tz::BackendKind::kCuda) {
    core.dl_device_type = kDLCUDA;
    core.dl_device_id = ranks.local_rank;
  }
  return tz::ok_status();
}

// Note [Gradients from another library's stream]
// CUDA gradients handed to reduce_grads were written by the caller's kernels
// on the caller's stream, which the engine's copy stream (a non-blocking one)
// does not follow. DLPack's rule for who waits: the consumer names the stream
// it will use, and stream=None means CUDA's legacy default stream. So the copy
// stream first waits for the work queued so far on the stream the caller
// names (`stream=`, an int as DLPack passes them: a cudaStream_t, 1 the
// legacy default, 2 the per-thread default), the legacy default stream when
// it names none (where torch and CuPy run unless told otherwise). 0 is taken
// as the legacy default stream too: DLPack calls it ambiguous, but it is what
// torch's `cuda_stream` and CuPy's `.ptr` give for the default stream (torch's
// from_dlpack reads it the same way). -1 says the caller has synchronised
// already. No host blocking until the copies' own end.
// The same reading serves fetch's `stream=`, the stream whose kernels read
// the block (its release waits for them; -1: the caller synchronises before
// the last view goes). `call` names the method in errors.
std::optional<void*> caller_stream(const CoreHandle& core, std::optional<std::int64_t> stream, std::string_view call) {
  if (stream && *stream == -1) return std::nullopt;
  if (core.dl_device_type != kDLCUDA) {
    if (stream) {
      raise_status(tz::invalid_argument(
          "Engine.{}(): stream={} is a CUDA stream; this engine is on cpu (leave stream unset)", call, *stream));
    }
    return std::nullopt;
  }
  if (!stream || *stream == 0) return nullptr;  // the legacy default stream
  if (*stream < -1) {
    raise_status(tz::invalid_argument(
        "Engine.{}(): stream={} is not a CUDA stream (pass a cudaStream_t as an int, 0 or 1 for the legacy default "
        "stream, 2 for the per-thread one, -1 when the caller has synchronised)", call, *stream));
  }
  return reinterpret_cast<void*>(static_cast<std::intptr_t>(*stream));
}

// Copies each gradient into a fresh, unzeroed GradBlock of `block` and zeroes
// the rest of it (None gradients, the gaps between parameters, the padding),
// then hands it to reduce_grads. On CUDA that is one flatten launch (gaps as
// zero slices) on the copy stream, after the caller's `producer` stream where
// there is one (Note [Gradients from another library's stream]), and one
// host wait per block: a copy per parameter and a memset per gap were one
// launch each. Caller holds the mutex, not the GIL.
tz::Status reduce_from(CoreHandle& core, std::size_t block, const std::vector<std::optional<ArrayInfo>>& grads,
                       std::optional<void*> producer) {
  TZ_ASSIGN_OR_RETURN(tz::GradBlock g, core.engine->grad_buffer(block, tz::GradFill::kUninitialised));
  const std::size_t bytes = tz::dtype_bytes(g.type());
  const tz::BlockLayout& b = core.engine->layout().blocks[block];
  std::vector<std::size_t> order(grads.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return b.params[x].offset < b.params[y].offset; });
  std::vector<tz::kernels::Slice> slices;  // in bytes; tensor nullptr: zeros
  slices.reserve(2 * grads.size() + 1);
  std::uint64_t written = 0;  // every element before this one has its value
  auto gap_to = [&](std::uint64_t to) {
    if (to > written) slices.push_back({nullptr, written * bytes, (to - written) * bytes});
  };
  for (std::size_t i : order) {
    if (!grads[i]) continue;
    gap_to(b.params[i].offset);
    slices.push_back({grads[i]->data, b.params[i].offset * bytes, b.params[i].numel * bytes});
    written = b.params[i].offset + b.params[i].numel;
  }
  gap_to(b.whole_numel);
  // On the Host backend "device" memory is host memory: memcpy and memset,
  // not a round trip through the backend's copy thread (tens of microseconds
  // per parameter, most of the per-module cost of tierzero.torch on small modules).
  if (core.device->kind() == tz::BackendKind::kHost) {
    tz::kernels::flatten_cpu(slices.data(), slices.size(), g.data());
    return core.engine->reduce_grads(std::move(g));
  }
  if (producer) {
    TZ_TRY_CTX(core.device->stream_wait_native(*core.copy_stream, *producer),
               "Engine.reduce_grads(): waiting for stream={:#x} (the gradients' producer) on {}",
               reinterpret_cast<std::uintptr_t>(*producer), core.device->name());
  }
  TZ_TRY_CTX(tz::kernels::flatten_cuda(slices.data(), slices.size(), g.data(), core.copy_stream->native_handle()),
             "Engine.reduce_grads(): copying the gradients of block '{}' into its buffer", b.name);
  TZ_TRY(core.device->synchronize_stream(*core.copy_stream));
  return core.engine->reduce_grads(std::move(g));
}

// Note [Closing an engine]
// close() frees the engine now, whoever still refers to the Python object
// (a torch model's hooks do, for as long as the model lives; module globals
// do until the interpreter tears them down, if it ever does, after the swap
// file should have gone). The PyEngine lets go of the core at once, so every
// later call raises "the engine is closed". If nothing else holds the core,
// it is destroyed there and then: the swap files, memory, threads and ranks'
// communicator with it. Gathered blocks whose views are still alive hold it
// too, and their memory is the engine's, so it cannot be freed under them:
// then the swap files' names are removed at once (the engine's open files
// keep their data; the disk space returns when the last view goes, or at
// exit) and the rest is freed with the last view. A call in flight on
// another thread holds the core the same way until it returns.
class PyEngine {
 public:
  PyEngine(std::optional<std::string> config_path, std::optional<std::string> config_json, const BlockList& blocks,
           const InitArrays& init, const std::string& initial, nb::object store, const std::string& store_name,
           double timeout_s)
      : core_(std::make_shared<CoreHandle>()) {
    const tz::InitialValues from = initial_values(initial, init);
    const tz::Config config = load(config_path, config_json);
    const std::vector<std::vector<const float*>> ptrs = init_pointers(blocks, init);
    if (!(timeout_s > 0) || timeout_s > 7 * 24 * 3600.0) {
      raise_status(tz::invalid_argument("Engine(): timeout={} s must be positive and at most a week", timeout_s));
    }
    const auto timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1e3));
    std::shared_ptr<tz::RendezvousStore> rendezvous;
    if (!store.is_none()) rendezvous = make_python_store(std::move(store), store_name);
    locked(*core_, [&] { return make_core(*core_, config, blocks, ptrs, from, rendezvous, timeout); });
  }

  std::unique_ptr<PyGathered> fetch(std::size_t block, std::optional<std::int64_t> stream, bool evaluation) {
    const std::shared_ptr<CoreHandle> core = live();
    const std::optional<void*> readers = caller_stream(*core, stream, "fetch");
    if (readers && *readers == reinterpret_cast<void*>(2)) {
      // Used when the last view goes, which may be on another thread (autograd's, the garbage collector's).
      raise_status(tz::invalid_argument(
          "Engine.fetch(): stream=2 is the per-thread default stream, which names another stream on each thread, "
          "and the block may be released on another thread: pass the stream's own handle"));
    }
    const tz::FetchFor purpose = evaluation ? tz::FetchFor::kEvaluation : tz::FetchFor::kTraining;
    tz::GatheredBlock g = locked(*core, [&] { return core->engine->fetch(block, purpose); });
    return std::make_unique<PyGathered>(core, std::move(g), readers);
  }

  void reduce_grads(std::size_t block, const std::vector<std::optional<InArray>>& grads,
                    std::optional<std::int64_t> stream) {
    const std::shared_ptr<CoreHandle> core = live();
    const auto& blocks = core->engine->layout().blocks;
    if (block >= blocks.size()) {
      raise_status(tz::invalid_argument("reduce_grads: block {} does not exist (the model has {})", block,
                                        blocks.size()));
    }
    const tz::BlockLayout& b = blocks[block];
    if (grads.size() != b.params.size()) {
      raise_status(tz::invalid_argument("reduce_grads: {} gradients for block '{}', which has {} parameters",
                                        grads.size(), b.name, b.params.size()));
    }
    ArraySpec spec{{core->engine->grad_type()}};
    spec.device = core->dl_device_type == kDLCUDA ? DeviceKind::kCuda : DeviceKind::kCpu;
    spec.device_id = core->dl_device_id;
    std::vector<std::optional<ArrayInfo>> infos(grads.size());
    for (std::size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i]) continue;
      const std::string arg = fmt::format("grads[{}] ({}.{})", i, b.name, b.params[i].name);
      infos[i] = check(*grads[i], spec, "Engine.reduce_grads()", arg);
      if (infos[i]->numel != b.params[i].numel) {
        raise_status(tz::invalid_argument("Engine.reduce_grads(): argument '{}' has {} elements; the parameter has {}",
                                          arg, infos[i]->numel, b.params[i].numel));
      }
    }
    const std::optional<void*> producer = caller_stream(*core, stream, "reduce_grads");
    locked(*core, [&] { return reduce_from(*core, block, infos, producer); });
  }

  // fn(engine) under the engine mutex, the GIL released; an error raises, a value is returned.
  template <typename Fn>
  auto call(Fn&& fn) {
    const std::shared_ptr<CoreHandle> core = live();  // kept for the call (Note [Closing an engine])
    return locked(*core, [&] { return fn(*core->engine); });
  }
  // A value read under the engine mutex (GIL released while waiting for it).
  template <typename Fn>
  auto read(Fn&& fn) {
    return call([&](tz::ZeroEngine& z) { return tz::Expected<decltype(fn(z))>(fn(z)); });
  }
  nb::dict step() {
    return report_dict(call([](tz::ZeroEngine& z) { return z.step(); }));
  }
  // For calls made with the GIL held, which close() cannot overtake.
  tz::ZeroEngine& engine() const { return *live()->engine; }
  const CoreHandle& core() const { return *live(); }

  // Note [Closing an engine]
  void close() {
    if (!core_) return;
    std::shared_ptr<CoreHandle> core = std::exchange(core_, nullptr);
    // Read with the GIL held: views and calls take and drop their references under it.
    const bool alone = core.use_count() == 1;
    nb::gil_scoped_release release;
    if (alone) {
      core.reset();
      return;
    }
    std::lock_guard<std::mutex> lock(core->mu);
    for (const std::string& path : core->engine->swap_files()) {
      if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
        TZ_LOG_WARN("python", "Engine.close(): removing the swap file {}: {}", path, std::strerror(errno));
      }
    }
  }
  bool closed() const { return !core_; }

  // A copy of `whole` goes in: a non-root rank's values are replaced by root's, but the caller's array is
  // left as it was.
  void set_master(std::size_t block, const InArray& whole, int root, const std::optional<std::string>& refusal) {
    const ArrayInfo info = check(whole, ArraySpec{{DType::kFp32}}, "Engine.set_master()", "whole");
    std::vector<float> values(static_cast<const float*>(info.data), static_cast<const float*>(info.data) + info.numel);
    const tz::Status refused = refusal ? tz::invalid_argument("{}", *refusal) : tz::Status();
    call([&](tz::ZeroEngine& z) { return z.set_master(block, values.data(), values.size(), root, refused); });
  }

  void agree(const std::string& value, const std::optional<std::string>& refusal, const std::string& what) {
    const tz::Status refused = refusal ? tz::invalid_argument("{}", *refusal) : tz::Status();
    call([&](tz::ZeroEngine& z) { return z.ranks().agree(value, refused, what); });
  }

  void broadcast(const WritableArg& data, int root) {
    const ArrayInfo info = check(data, ArraySpec{}, "Engine.broadcast()", "data");
    call([&](tz::ZeroEngine& z) { return z.ranks().broadcast(info.data, info.nbytes, root); });
  }

  nb::ndarray<nb::numpy, float> gather_master(std::size_t block) {
    std::vector<float> v = call([&](tz::ZeroEngine& z) { return z.gather_master(block); });
    auto* owned = new std::vector<float>(std::move(v));
    nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
    const std::size_t n = owned->size();
    return nb::ndarray<nb::numpy, float>(owned->data(), {n}, owner);
  }

 private:
  // The core, or RuntimeError "the engine is closed" (Note [Closing an engine]).
  std::shared_ptr<CoreHandle> live() const {
    if (!core_) {
      raise_status(tz::failed_precondition("tierzero.Engine: the engine is closed (by close(), or at the end of its "
                                           "with block); make a new one"));
    }
    return core_;
  }

  std::shared_ptr<CoreHandle> core_;
};

}  // namespace

void bind_engine(nb::module_& m) {
  m.def(
      "read_checkpoint_client_state",
      [](const std::string& dir, const std::optional<std::string>& tag) -> nb::object {
        if (tag && tag->empty()) raise_status(tz::invalid_argument("load_checkpoint: tag is empty; give a name, or None"));
        tz::Expected<std::optional<std::string>> state = [&] {
          nb::gil_scoped_release release;
          return tz::read_checkpoint_client_state(dir, tag.value_or(""));
        }();
        const std::optional<std::string> bytes = value_or_raise(std::move(state));
        return bytes ? nb::object(nb::bytes(bytes->data(), bytes->size())) : nb::none();
      },
      nb::arg("dir"), nb::arg("tag") = nb::none(),
      "The client state bytes of the checkpoint load_checkpoint(dir, tag=tag) would load, checksum verified (None "
      "when saved without). Reads files only, so a caller can check it before the collective load.");
  nb::class_<PyGathered>(m, "GatheredBlock", nb::is_weak_referenceable(),
                         "A whole block's parameters, gathered on the engine's device. Its arrays are zero-copy views "
                         "that keep it alive; the engine gets the buffer back when the last view is gone.")
      .def_prop_ro("index", &PyGathered::index)
      .def_prop_ro("name", [](PyGathered& g) { return g.layout().name; })
      .def_prop_ro("data", &PyGathered::data, "The whole gathered buffer, (whole_numel,) in the parameter dtype.")
      .def_prop_ro("stream", &PyGathered::readers,
                   "The stream whose work the release waits for (as fetch's stream=; 0 the legacy default), None "
                   "when it waits for none (a cpu engine, or stream=-1).")
      .def("param", &PyGathered::param, nb::arg("i"), "Parameter i as an array of its shape (a view of data).");
  nb::class_<tz::FetchMark>(m, "FetchMark",
                            "Where a micro-batch's training fetches had got to (Engine.fetch_mark), for "
                            "Engine.rewind_fetches.")
      .def_ro("micro_batch", &tz::FetchMark::micro_batch, "The micro-batch, counted since the engine was made.")
      .def_ro("fetches", &tz::FetchMark::fetches, "Training fetches into it.")
      .def("__repr__", [](const tz::FetchMark& m) {
        return fmt::format("FetchMark(micro_batch={}, fetches={})", m.micro_batch, m.fetches);
      });
  nb::class_<PyEngine>(m, "Engine",
                       "ZeRO-partitioned, tiered model states and the training step (tierzero/engine/zero.h). Ranks "
                       "come from the environment as torchrun sets it (one rank without it).")
      .def(nb::init<std::optional<std::string>, std::optional<std::string>, const BlockList&, const InitArrays&,
                    const std::string&, nb::object, const std::string&, double>(),
           nb::arg("config_path") = nb::none(), nb::arg("config_json") = nb::none(),
           nb::arg("blocks") = BlockList{}, nb::arg("init") = InitArrays{}, nb::arg("initial_values") = "rank0",
           nb::arg("store") = nb::none(), nb::arg("store_name") = "a Python store", nb::arg("timeout") = 300.0,
           "blocks: [(block name, [(param name, shape)])]; init: per block, per parameter, a float32 cpu array of its "
           "numel or None (zeros); empty: all zeros. initial_values: 'rank0' (every rank starts from rank 0's init), "
           "'same' (every rank's init is the same: no broadcast) or 'later' (no init: each block gets its values "
           "from set_master() or load_checkpoint() before use; tz::InitialValues). store: a torch.distributed Store "
           "every rank reaches, through which ranks meet (None: MPI or the rendezvous directory); store_name: how "
           "errors name it; timeout: seconds for the ranks to meet and for each collective.")
      .def("fetch", &PyEngine::fetch, nb::arg("block"), nb::kw_only(), nb::arg("stream") = nb::none(),
           nb::arg("evaluation") = false,
           "The whole block, gathered (waits for NVMe and collectives). On CUDA the buffer goes back to the engine "
           "when the last view is gone, to be reused only after the work queued by then on `stream` (the one the "
           "caller's kernels read it on, an int as DLPack passes streams: a cudaStream_t, 0 or 1 the legacy default "
           "stream, -1 when the caller synchronises first), by default the legacy default stream. The stream must "
           "outlive the block's views. evaluation=True: a fetch outside training's order (a forward with no "
           "backward), fetched on demand without disturbing the prefetch trace (tz::FetchFor).")
      .def("reduce_grads", &PyEngine::reduce_grads, nb::arg("block"), nb::arg("grads"), nb::kw_only(),
           nb::arg("stream") = nb::none(),
           "Copies each parameter's gradient (the grad dtype, on the engine's device, C-contiguous, the parameter's "
           "numel; None: zeros) into the engine's gradient buffer and queues the reduce-scatter. On CUDA the copies "
           "wait for the work queued on `stream` (an int as DLPack passes streams: a cudaStream_t, 0 or 1 the legacy "
           "default stream, 2 the per-thread one, -1 none), by default the legacy default stream.")
      .def("step", &PyEngine::step, "Ends a micro-batch; at the accumulation boundary runs the optimizer. A dict.")
      .def("close", &PyEngine::close,
           "Frees the engine now: its swap files, memory, threads and communicator, whatever else still refers to "
           "this object. Gathered blocks whose views are alive keep the engine's memory until they go (their swap "
           "files are removed at once). Every later call raises RuntimeError; closing again does nothing.")
      .def_prop_ro("closed", &PyEngine::closed, "Whether close() has been called.")
      .def("fetch_mark", [](PyEngine& e) { return e.read([](tz::ZeroEngine& z) { return z.fetch_mark(); }); },
           "Where this micro-batch's training fetches have got to: a FetchMark for rewind_fetches().")
      .def("rewind_fetches",
           [](PyEngine& e, const tz::FetchMark& mark) { e.call([&](tz::ZeroEngine& z) { return z.rewind_fetches(mark); }); },
           nb::arg("mark"),
           "Forgets the training fetches since `mark` (fetch_mark() in this micro-batch) after a forward that "
           "raised, so the prefetch order goes on from there (tz::ZeroEngine::rewind_fetches). Gradients already "
           "reduced stay. Every rank rewinds at the same point or none does; a mark from another micro-batch is a "
           "ValueError.")
      .def("save_checkpoint",
           [](PyEngine& e, const std::string& d, const std::optional<std::string>& tag,
              const std::optional<nb::bytes>& client_state, bool save_latest, const std::optional<std::string>& refusal,
              int keep_last) {
             tz::CheckpointSave options{.tag = tag.value_or(""), .save_latest = save_latest, .keep_last = keep_last};
             if (client_state) options.client_state = std::string(client_state->c_str(), client_state->size());
             // Refusals go through the save, so every rank fails together (CheckpointSave::refusal).
             if (refusal) {
               options.refusal = tz::invalid_argument("{}", *refusal);
             } else if (tag && tag->empty()) {
               options.refusal = tz::invalid_argument("save_checkpoint: tag is empty; give a name, or None");
             }
             return e.call([&](tz::ZeroEngine& z) { return z.save_checkpoint(d, options); });
           },
           nb::arg("dir"), nb::kw_only(), nb::arg("tag") = nb::none(), nb::arg("client_state") = nb::none(),
           nb::arg("save_latest") = true, nb::arg("refusal") = nb::none(), nb::arg("keep_last") = 0,
           "Saves every rank's states under dir/<tag> (default step-<N>; an existing tag is replaced atomically), "
           "with rank 0's client_state bytes, and points dir/latest at it unless save_latest is False; keep_last N "
           "then removes all but the newest N complete checkpoints (never the one latest names). Returns the "
           "checkpoint's directory. refusal: this rank's reason not to save (every rank then fails, this one with "
           "the reason as a ValueError).")
      .def("load_checkpoint",
           [](PyEngine& e, const std::string& d, const std::optional<std::string>& tag, bool weights_only,
              const std::optional<std::string>& refusal, bool checked, const std::optional<nb::bytes>& client_state) {
             if (tag && tag->empty()) raise_status(tz::invalid_argument("load_checkpoint: tag is empty; give a name, or None"));
             tz::CheckpointLoad options{.tag = tag.value_or(""), .weights_only = weights_only};
             if (refusal) options.refusal = tz::invalid_argument("{}", *refusal);
             if (checked) {
               // The caller checked this client state (read_checkpoint_client_state) before the load; the
               // load must find the same bytes. Plain C++: no Python runs under the engine mutex.
               std::optional<std::string> expected;
               if (client_state) expected = std::string(client_state->c_str(), client_state->size());
               options.check_client_state = [expected](const std::optional<std::string>& found) {
                 return found == expected ? tz::ok_status()
                                          : tz::data_corruption("the client state changed between its check and "
                                                                "the load (was the checkpoint replaced?)");
               };
             }
             tz::LoadedCheckpoint loaded = e.call([&](tz::ZeroEngine& z) { return z.load_checkpoint(d, options); });
             nb::object state = nb::none();
             if (loaded.client_state) state = nb::bytes(loaded.client_state->data(), loaded.client_state->size());
             return nb::make_tuple(loaded.path, state);
           },
           nb::arg("dir"), nb::kw_only(), nb::arg("tag") = nb::none(), nb::arg("weights_only") = false,
           nb::arg("refusal") = nb::none(), nb::arg("checked") = false, nb::arg("client_state") = nb::none(),
           "Loads dir/<tag>, or dir/latest (or dir itself when it is a checkpoint). Returns (the checkpoint's "
           "directory, the client_state bytes saved with it or None). weights_only: the weights alone; the "
           "optimizer's moments, step, learning rate and loss scale stay this engine's (the checkpoint's optimizer "
           "may differ). refusal: this rank's reason not to load (every rank then fails before anything is "
           "replaced). checked=True: the caller checked `client_state` (read_checkpoint_client_state) and the "
           "load must find the same bytes.")
      .def("export_safetensors",
           [](PyEngine& e, const std::string& p, const std::optional<std::vector<std::vector<std::string>>>& names) {
             if (names && names->empty()) {
               raise_status(tz::invalid_argument("export_safetensors: names is empty; give one list per block, or "
                                                 "None for '<block>.<param>' names"));
             }
             e.call([&](tz::ZeroEngine& z) {
               return z.export_safetensors(p, names.value_or(std::vector<std::vector<std::string>>{}));
             });
           },
           nb::arg("path"), nb::arg("names") = nb::none(),
           "The fp32 weights as one safetensors file: tensors named '<block>.<param>', or names[b][p] (one list "
           "per block, one name per parameter). A collective; rank 0 writes it, never a partial file.")
      .def("gather_master", &PyEngine::gather_master, nb::arg("block"),
           "The block's fp32 master weights, (whole_numel,) numpy (a copy; a collective over ranks).")
      .def("set_master", &PyEngine::set_master, nb::arg("block"), nb::arg("whole"), nb::kw_only(),
           nb::arg("root") = 0, nb::arg("refusal") = nb::none(),
           "Replaces the block's fp32 master weights and 16-bit parameters with rank `root`'s `whole` (float32, "
           "cpu, C-contiguous, whole_numel values as gather_master gives). A collective: every rank calls it with "
           "the same block and root. Moments, step and accumulated gradients stay. Refused while a gathered block is "
           "alive; not for use between a forward and its backward. refusal: "
           "this rank's reason not to go on (every rank then fails, this one with the reason as a ValueError).")
      .def("has_values", [](PyEngine& e, std::size_t block) { return e.engine().has_values(block); },
           nb::arg("block"),
           "Whether the block has values: False only on an engine made with initial_values='later' until "
           "set_master() or load_checkpoint() sets it (and for a block that does not exist).")
      .def("agree", &PyEngine::agree, nb::arg("value"), nb::kw_only(), nb::arg("refusal") = nb::none(),
           nb::arg("what") = "agree",
           "A collective check before work every rank must do alike: raises on every rank when the ranks' `value` "
           "strings differ (ValueError quoting this rank's) or any rank passes a `refusal` (that rank: ValueError "
           "with it; the others: OSError saying how many refused). `what` names the work in the messages.")
      .def("broadcast", &PyEngine::broadcast, nb::arg("data"), nb::kw_only(), nb::arg("root") = 0,
           "Rank `root`'s `data` (a writable, C-contiguous CPU array of any dtype) into every rank's, in place. A "
           "collective: every rank passes an array of the same size and the same root.")
      .def("record_timeline", [](PyEngine& e, bool on) { e.engine().record_timeline(on); }, nb::arg("on"))
      .def("write_timeline",
           [](PyEngine& e, const std::string& p) { e.call([&](tz::ZeroEngine& z) { return z.write_timeline(p); }); },
           nb::arg("path"))
      .def("describe", [](PyEngine& e) { return e.engine().describe(); })
      .def("layout", [](PyEngine& e) { return layout_list(e.engine().layout()); })
      // Read under the engine mutex: step() may be running on another thread.
      .def_prop_ro("loss_scale",
                   [](PyEngine& e) { return e.read([](tz::ZeroEngine& z) { return z.loss_scale(); }); })
      .def_prop_ro("gradient_accumulation_steps",
                   [](PyEngine& e) { return e.engine().config().gradient_accumulation_steps; },
                   "Micro-batches per optimizer step, as the engine runs them (derived from train_batch_size "
                   "and the ranks where the config says so).")
      .def_prop_ro("train_micro_batch_size_per_gpu",
                   [](PyEngine& e) { return e.engine().config().train_micro_batch_size_per_gpu; })
      .def_prop_ro("train_batch_size",
                   // resolve_batch() recorded it when the engine was made (Note [Batch keys])
                   [](PyEngine& e) { return e.engine().config().batch_given.train_batch_size.value(); },
                   "train_micro_batch_size_per_gpu x gradient_accumulation_steps x ranks.")
      .def_prop_ro("optimizer_steps",
                   [](PyEngine& e) { return e.read([](tz::ZeroEngine& z) { return z.optimizer_steps(); }); },
                   "Optimizer steps taken (skipped fp16 steps not counted; restored by load_checkpoint).")
      .def_prop_ro("learning_rate",
                   [](PyEngine& e) { return e.read([](tz::ZeroEngine& z) { return z.learning_rate(); }); },
                   "The learning rate the next optimizer step will use (the config's scheduler, or the optimizer's).")
      .def("set_learning_rate",
           [](PyEngine& e, double lr) { e.call([&](tz::ZeroEngine& z) { return z.set_learning_rate(lr); }); },
           nb::arg("lr"),
           "Sets the optimizer's learning rate for the next steps (finite, >= 0); refused when the config has a "
           "scheduler block. Checkpoints carry it once set.")
      .def("set_weight_decay",
           [](PyEngine& e, std::size_t block, std::size_t param, double weight_decay) {
             e.call([&](tz::ZeroEngine& z) { return z.set_weight_decay(block, param, weight_decay); });
           },
           nb::arg("block"), nb::arg("param"), nb::arg("weight_decay"),
           "One parameter's weight decay (finite, >= 0) in place of the config's: param groups that differ in "
           "weight_decay. A hyperparameter: checkpoints do not carry it; set the same on every rank.")
      .def("weight_decay",
           [](PyEngine& e, std::size_t block, std::size_t param) {
             return e.read([&](tz::ZeroEngine& z) { return z.weight_decay(block, param); });
           },
           nb::arg("block"), nb::arg("param"), "The weight decay the parameter steps with (the config's unless set).")
      .def_prop_ro(
          "optimizer",
          [](PyEngine& e) {
            const tz::OptimizerConfig& o = e.engine().config().optimizer;
            nb::dict d;
            d["type"] = o.type;
            d["betas"] = nb::make_tuple(o.beta1, o.beta2);
            d["eps"] = o.eps;
            d["weight_decay"] = o.weight_decay;
            d["amsgrad"] = o.amsgrad;
            return d;
          },
          "The optimizer the engine runs, as the config resolved it: type (\"Adam\" is L2 Adam; DeepSpeed's "
          "\"Adam\" with adam_w_mode is \"AdamW\" here), betas, eps, weight_decay, amsgrad. The learning rate is "
          "learning_rate.")
      .def_prop_ro("zero_stage", [](PyEngine& e) { return e.engine().config().zero.stage; },
                   "The config's zero_optimization.stage.")
      .def_prop_ro("gradient_clipping", [](PyEngine& e) { return e.engine().config().gradient_clipping; },
                   "The config's gradient_clipping (0: off).")
      .def_prop_ro("dataloader_drop_last", [](PyEngine& e) { return e.engine().config().dataloader_drop_last; },
                   "The config's dataloader_drop_last (DeepSpeed's; for the data loader initialize() builds).")
      .def_prop_ro("param_dtype", [](PyEngine& e) { return numpy_name(e.engine().param_type()); })
      .def_prop_ro("grad_dtype", [](PyEngine& e) { return numpy_name(e.engine().grad_type()); })
      .def_prop_ro("device", [](PyEngine& e) { return describe_device(e.core().dl_device_type, e.core().dl_device_id); })
      .def_prop_ro("rank", [](PyEngine& e) { return e.engine().rank(); })
      .def_prop_ro("world_size", [](PyEngine& e) { return e.engine().world_size(); });
}

}  // namespace tzpy
