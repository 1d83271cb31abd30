// tierzero._core.IoEngine / SwapStore / IoFuture: the NVMe tier
// (tierzero/nvme/*.h) over caller buffers (numpy, torch: any contiguous CPU
// array), zero-copy. tierzero.nvme adds aligned buffers and the benchmark.
//
// Note [Buffer lifetime in flight]
// A read or write keeps using the caller's buffer until it completes, after
// the Python call has returned. The IoFuture holds a reference to the buffer's
// array, so the memory cannot be freed under the I/O, and a future dropped
// before completion waits for it in its destructor (GIL released) rather than
// leave a request writing into memory nobody owns.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "arrays.h"
#include "errors.h"
#include "tierzero/nvme.h"

namespace tzpy {
namespace {

namespace nv = tz::nvme;

const ArraySpec kBytes{{}, -1, true, DeviceKind::kCpu};  // any dtype

class PyIoFuture {
 public:
  PyIoFuture(nv::IoFuture f, nb::object keep) : future_(std::move(f)), keep_(std::move(keep)) {}
  PyIoFuture(PyIoFuture&&) = default;
  ~PyIoFuture() {
    if (!future_.valid() || done_) return;
    nb::gil_scoped_release release;
    future_.wait().ignore_error();  // Note [Buffer lifetime in flight]
  }
  bool ready() const { return done_ || future_.ready(); }
  void wait(std::optional<double> timeout_s) {
    if (timeout_s && !(*timeout_s >= 0)) {
      raise_status(tz::invalid_argument("IoFuture.wait(): timeout {} must be a number of seconds >= 0", *timeout_s));
    }
    // Beyond a year is as good as forever (and would overflow the milliseconds).
    const bool forever = !timeout_s || *timeout_s > 365.0 * 24 * 3600;
    tz::Status s;
    {
      nb::gil_scoped_release release;
      s = forever ? future_.wait()
                  : future_.wait_for(std::chrono::milliseconds(static_cast<std::int64_t>(*timeout_s * 1e3)));
    }
    if (s.code() != tz::ErrorCode::kTimeout) done_ = true;
    check(s);
  }

 private:
  nv::IoFuture future_;
  nb::object keep_;  // the buffer's array
  bool done_ = false;
};

nv::IoBackend backend_of(const std::string& name) {
  if (name == "auto") return nv::IoBackend::kAuto;
  if (name == "io_uring") return nv::IoBackend::kUring;
  if (name == "threads") return nv::IoBackend::kThreads;
  raise_status(tz::invalid_argument("backend '{}': expected auto, io_uring or threads", name));
}

nv::EngineOptions engine_options(std::size_t block_size, int queue_depth, int rings, bool single_submit, bool sqpoll,
                                 bool fixed_buffers, const std::string& backend) {
  nv::EngineOptions o;
  o.block_size_bytes = block_size;
  o.queue_depth = queue_depth;
  o.rings = rings;
  o.single_submit = single_submit;
  o.sqpoll = sqpoll;
  o.fixed_buffers = fixed_buffers;
  o.backend = backend_of(backend);
  return o;
}

nb::dict engine_stats(const nv::EngineStats& s) {
  nb::dict d;
  d["requests"] = s.requests;
  d["pieces"] = s.pieces;
  d["bytes_read"] = s.bytes_read;
  d["bytes_written"] = s.bytes_written;
  d["short_transfers"] = s.short_transfers;
  d["retries"] = s.retries;
  d["errors"] = s.errors;
  d["fixed_buffer_pieces"] = s.fixed_buffer_pieces;
  return d;
}

class PyIoEngine {
 public:
  explicit PyIoEngine(const nv::EngineOptions& o) {
    tz::Expected<std::unique_ptr<nv::IoEngine>> e = [&] {
      nb::gil_scoped_release release;
      return nv::IoEngine::create(o);
    }();
    engine_ = value_or_raise(std::move(e));
  }
  ~PyIoEngine() {
    nb::gil_scoped_release release;  // waits for requests in flight, joins the rings' threads
    engine_.reset();
  }

  std::uint32_t open(const std::string& path, bool create, bool exclusive, bool truncate, bool writable,
                     std::uint64_t size_bytes, bool direct, bool allow_buffered) {
    nv::FileOptions o{create, exclusive, truncate, writable, size_bytes, direct, allow_buffered};
    tz::Expected<nv::FileId> f = [&] {
      nb::gil_scoped_release release;
      return engine_->open(path, o);
    }();
    return value_or_raise(std::move(f)).index;
  }
  void close(std::uint32_t file) {
    tz::Status s;
    {
      nb::gil_scoped_release release;
      s = engine_->close(nv::FileId{file});
    }
    check(s);
  }
  nb::dict file_info(std::uint32_t file) const {
    const nv::FileInfo i = value_or_raise(engine_->file_info(nv::FileId{file}));
    nb::dict d;
    d["path"] = i.path;
    d["direct"] = i.direct;
    d["mem_align"] = i.mem_align;
    d["offset_align"] = i.offset_align;
    d["filesystem"] = i.filesystem;
    d["device"] = i.device;
    return d;
  }

  // buffer's bytes to/from the segments (file, offset, length), in order; the
  // lengths must add up to the buffer's size.
  PyIoFuture submit(const std::string& op, nb::handle buffer,
                    const std::vector<std::tuple<std::uint32_t, std::uint64_t, std::size_t>>& segments) {
    const bool read = op == "read";
    if (!read && op != "write") raise_status(tz::invalid_argument("op '{}': expected read or write", op));
    const ArrayInfo b = check(as_array(buffer, "IoEngine.submit()", "buffer"), kBytes, "IoEngine.submit()", "buffer");
    nv::IoRequest r{.op = read ? nv::IoOp::kRead : nv::IoOp::kWrite, .buffer = b.data};
    std::size_t total = 0;
    for (const auto& [file, offset, length] : segments) {
      // Each within the buffer, so the sum below cannot wrap around.
      if (length > b.nbytes - std::min(total, b.nbytes)) {
        raise_status(tz::invalid_argument("IoEngine.submit(): segment {} (length {}) runs past the end of 'buffer' "
                                          "({} bytes)",
                                          r.segments.size(), length, b.nbytes));
      }
      r.segments.push_back({nv::FileId{file}, offset, length});
      total += length;
    }
    if (total != b.nbytes) {
      raise_status(tz::invalid_argument("IoEngine.submit(): the segments cover {} bytes; 'buffer' has {}", total,
                                        b.nbytes));
    }
    return PyIoFuture(engine_->submit(std::move(r)), nb::borrow(buffer));
  }

  nv::IoEngine& engine() { return *engine_; }
  std::shared_ptr<nv::IoEngine> shared() { return engine_; }

 private:
  std::shared_ptr<nv::IoEngine> engine_;
};

void bind_io_engine(nb::module_& m) {
  nb::class_<PyIoFuture>(m, "IoFuture", "The completion of one read or write; holds the buffer until then.")
      .def("wait", &PyIoFuture::wait, nb::arg("timeout") = nb::none(),
           "Blocks (GIL released) until the request completes; raises its error (OSError naming the file and "
           "offset). With a timeout in seconds, TimeoutError when it has not completed by then.")
      .def("ready", &PyIoFuture::ready);
  nb::class_<PyIoEngine>(m, "IoEngine",
                         "Asynchronous file I/O over io_uring (O_DIRECT, fixed buffers), or a pread/pwrite pool "
                         "where io_uring is refused.")
      .def(
          "__init__",
          [](PyIoEngine* self, std::size_t block_size, int queue_depth, int rings, bool single_submit, bool sqpoll,
             bool fixed_buffers, const std::string& backend) {
            new (self) PyIoEngine(
                engine_options(block_size, queue_depth, rings, single_submit, sqpoll, fixed_buffers, backend));
          },
          nb::arg("block_size") = std::size_t{1} << 20, nb::arg("queue_depth") = 8, nb::arg("rings") = 1,
          nb::arg("single_submit") = false, nb::arg("sqpoll") = false, nb::arg("fixed_buffers") = true,
          nb::arg("backend") = "auto")
      .def("open", &PyIoEngine::open, nb::arg("path"), nb::arg("create") = false, nb::arg("exclusive") = false,
           nb::arg("truncate") = false, nb::arg("writable") = true, nb::arg("size_bytes") = 0,
           nb::arg("direct") = true, nb::arg("allow_buffered") = false,
           "Opens a file; returns its id. A directory that refuses O_DIRECT (or tmpfs) is an error naming the path "
           "unless allow_buffered.")
      .def("close", &PyIoEngine::close, nb::arg("file"))
      .def("file_info", &PyIoEngine::file_info, nb::arg("file"))
      .def("submit", &PyIoEngine::submit, nb::arg("op"), nb::arg("buffer"), nb::arg("segments"),
           "Queues op ('read' | 'write') of 'buffer' (any dtype, C-contiguous, cpu, writable; aligned to the "
           "file's mem_align for O_DIRECT) over segments [(file, offset, length)] whose lengths add up to its size; "
           "returns an IoFuture, which keeps the buffer alive until the request completes.")
      .def(
          "register_buffer",
          [](PyIoEngine& e, const WritableArg& buffer) {
            const ArrayInfo b = check(buffer, kBytes, "IoEngine.register_buffer()", "buffer");
            tz::Status s;
            {
              nb::gil_scoped_release release;
              s = e.engine().register_buffer(b.data, b.nbytes);
            }
            check(s);
          },
          nb::arg("buffer"), "Registers the buffer for fixed-buffer I/O; keep it alive until unregister_buffer.")
      .def(
          "unregister_buffer",
          [](PyIoEngine& e, const WritableArg& buffer) {
            const ArrayInfo b = check(buffer, kBytes, "IoEngine.unregister_buffer()", "buffer");
            tz::Status s;
            {
              nb::gil_scoped_release release;
              s = e.engine().unregister_buffer(b.data);
            }
            check(s);
          },
          nb::arg("buffer"), "Stops fixed-buffer I/O from the buffer (one never registered: nothing to undo).")
      .def_prop_ro("backend", [](PyIoEngine& e) { return std::string(nv::io_backend_name(e.engine().backend())); })
      .def("stats", [](PyIoEngine& e) { return engine_stats(e.engine().stats()); })
      .def("describe", [](PyIoEngine& e) { return e.engine().describe(); });
  m.def(
      "checksum",
      [](const InArray& data) {
        const ArrayInfo b = check(data, kBytes, "checksum()", "data");
        nb::gil_scoped_release release;
        return nv::checksum(b.data, b.nbytes);
      },
      nb::arg("data"), "XXH3-64 of the array's bytes (the checksum the swap store keeps per piece).");
}

}  // namespace

void bind_swap_store(nb::module_& m);

void bind_nvme(nb::module_& m) {
  bind_io_engine(m);
  bind_swap_store(m);
}

}  // namespace tzpy

namespace tzpy {
namespace {

class PySwapStore {
 public:
  PySwapStore(const nv::SwapOptions& o, PyIoEngine* engine) {
    std::shared_ptr<nv::IoEngine> shared = engine ? engine->shared() : nullptr;
    tz::Expected<std::unique_ptr<nv::SwapStore>> s = [&] {
      nb::gil_scoped_release release;  // fallocates the swap files
      return nv::SwapStore::create(o, shared);
    }();
    store_ = value_or_raise(std::move(s));
  }
  ~PySwapStore() {
    nb::gil_scoped_release release;  // waits for requests, removes the swap files
    store_.reset();
  }

  // The buffer must be padded_bytes(extent) long (checked here, with the
  // numbers, before the store sees it).
  PyIoFuture io(bool read, nv::ExtentId extent, nb::handle buffer) {
    const char* where = read ? "SwapStore.read()" : "SwapStore.write()";
    const ArrayInfo b = check(as_array(buffer, where, "buffer"), kBytes, where, "buffer");
    const std::size_t need = store_->padded_bytes(value_or_raise(store_->extent_bytes(extent)));
    if (b.nbytes != need) {
      raise_status(tz::invalid_argument("{}: 'buffer' has {} bytes; extent {} needs padded_bytes = {}", where,
                                        b.nbytes, extent, need));
    }
    nv::IoFuture f = read ? store_->read(extent, b.data) : store_->write(extent, b.data);
    return PyIoFuture(std::move(f), nb::borrow(buffer));
  }

  nv::SwapStore& store() { return *store_; }

 private:
  std::unique_ptr<nv::SwapStore> store_;
};

nb::dict swap_stats(const nv::SwapStats& s) {
  nb::dict d;
  d["capacity_bytes"] = s.capacity_bytes;
  d["used_bytes"] = s.used_bytes;
  d["peak_used_bytes"] = s.peak_used_bytes;
  d["extents"] = s.extents;
  d["bytes_written"] = s.bytes_written;
  d["bytes_read"] = s.bytes_read;
  d["corrupt_reads"] = s.corrupt_reads;
  d["failed_writes"] = s.failed_writes;
  return d;
}

}  // namespace

void bind_swap_store(nb::module_& m) {
  nb::class_<PySwapStore>(m, "SwapStore",
                          "Checksummed byte extents in preallocated swap files striped over one or more paths; the "
                          "files are removed when the store is destroyed.")
      .def(
          "__init__",
          [](PySwapStore* self, std::vector<std::string> paths, std::uint64_t capacity_bytes, std::size_t stripe_bytes,
             bool checksums, bool allow_buffered, PyIoEngine* engine, std::size_t block_size, int queue_depth,
             int rings, const std::string& backend) {
            nv::SwapOptions o{.paths = std::move(paths), .capacity_bytes = capacity_bytes,
                              .stripe_bytes = stripe_bytes, .checksums = checksums, .allow_buffered = allow_buffered};
            o.engine = engine_options(block_size, queue_depth, rings, false, false, true, backend);
            new (self) PySwapStore(o, engine);
          },
          nb::arg("paths"), nb::arg("capacity_bytes"), nb::arg("stripe_bytes") = 0, nb::arg("checksums") = true,
          nb::arg("allow_buffered") = false, nb::arg("engine") = nb::none(),
          nb::arg("block_size") = std::size_t{1} << 20, nb::arg("queue_depth") = 8, nb::arg("rings") = 1,
          nb::arg("backend") = "auto",
          "Creates one swap file per path and reserves capacity_bytes over them (OSError naming the path, the size "
          "and the space free when a disk is too small). engine: share an IoEngine (kept alive by the store).")
      .def(
          "allocate",
          [](PySwapStore& s, std::size_t bytes) {
            tz::Expected<nv::ExtentId> e = s.store().allocate(bytes);
            return value_or_raise(std::move(e));
          },
          nb::arg("bytes"), "Reserves padded_bytes(bytes) of swap; returns the extent id (OSError NoSpace when full).")
      .def("free", [](PySwapStore& s, nv::ExtentId e) { check(s.store().free(e)); }, nb::arg("extent"))
      .def(
          "write", [](PySwapStore& s, nv::ExtentId e, nb::handle buffer) { return s.io(false, e, buffer); },
          nb::arg("extent"), nb::arg("buffer"),
          "Queues a write of 'buffer' (C-contiguous cpu array of exactly padded_bytes(extent) bytes, aligned to "
          "buffer_alignment); returns an IoFuture.")
      .def(
          "read", [](PySwapStore& s, nv::ExtentId e, nb::handle buffer) { return s.io(true, e, buffer); },
          nb::arg("extent"), nb::arg("buffer"),
          "Queues a read into 'buffer'; its wait() raises OSError (code DataCorruption) naming the extent, file and "
          "offset when a checksum does not match.")
      .def("extent_bytes", [](PySwapStore& s, nv::ExtentId e) { return value_or_raise(s.store().extent_bytes(e)); },
           nb::arg("extent"))
      .def("padded_bytes", [](PySwapStore& s, std::size_t n) { return s.store().padded_bytes(n); }, nb::arg("bytes"))
      .def_prop_ro("buffer_alignment", [](PySwapStore& s) { return s.store().buffer_alignment(); })
      .def(
          "placement",
          [](PySwapStore& s, nv::ExtentId e) {
            nb::list out;
            for (const nv::ExtentPlacement& p : value_or_raise(s.store().placement(e))) {
              out.append(nb::make_tuple(p.path, p.offset, p.bytes));
            }
            return out;
          },
          nb::arg("extent"), "[(swap file, offset, bytes)] of each path's share of the extent.")
      .def("file_paths", [](PySwapStore& s) { return s.store().file_paths(); })
      .def("stats", [](PySwapStore& s) { return swap_stats(s.store().stats()); });
}

}  // namespace tzpy
