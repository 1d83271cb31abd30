#include "tierzero/common/shared_library.h"

#include <dlfcn.h>

#include <fmt/format.h>

// Note [CUDA libraries load on first use]
// A program linked against a shared library has the dynamic linker map and
// relocate it before main(), whether or not the run ever calls it. cuBLAS
// (with cuBLASLt, 540 MB of file) and NCCL (218 MB) linked that way cost
// tierzero-train 219 MiB of RSS for --help on a host with no GPU at all, 7 MiB
// without them (issue #23; bench/RESULTS.md has the figures). So:
//   - the CUDA runtime is linked statically (CUDA::cudart_static), which maps
//     nothing: it opens the driver (libcuda.so.1) itself on its first call;
//   - cuBLAS and NCCL are not linked. Each module that calls one keeps a
//     small stub file (train/src/cublas_stubs.cpp, comm/src/nccl_stubs.cpp)
//     defining the entry points it uses, with the API's own names and
//     signatures (checked against the vendor header), hidden so they leave
//     neither the executable nor the Python module; each forwards to the
//     function that file's load function (load_cublas, load_nccl) resolved
//     with SharedLibrary. TensorFlow's stream executor loads cuBLAS, cuDNN
//     and NCCL the same way;
//   - the code that needs the library calls the load function at its entry
//     (the CUDA GPT's Context::create, create_nccl_communicator), which
//     returns a Status naming the library and every path tried. A CPU run
//     never reaches those entries, so never maps the libraries; the test
//     CpuTrainerMapsNoCudaLibrary reads a running trainer's /proc/PID/maps.
// A plugin holding all the CUDA code instead would have needed its own copy
// of the static libraries below it (two loggers, two capability probes) or
// the executable's symbols exported to it (and RTLD_GLOBAL under Python);
// two dozen entry points are less to keep right.

namespace tz {

Expected<SharedLibrary> SharedLibrary::open(std::string_view what, const std::vector<std::string>& candidates) {
  std::string tried;
  for (const std::string& path : candidates) {
    if (path.empty()) continue;
    // RTLD_NOW: a library missing one of its own dependencies fails here, with
    // the name, rather than at some later call. RTLD_LOCAL: its symbols stay
    // out of the global scope (another copy, torch's, may be loaded).
    // RTLD_NODELETE: threads the library started may outlive the handle.
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (handle != nullptr) {
      SharedLibrary lib;
      lib.handle_ = handle;
      lib.path_ = path;
      return lib;
    }
    const char* reason = ::dlerror();
    tried += fmt::format("{}{}", tried.empty() ? "" : "; ", reason != nullptr ? reason : path + ": dlopen failed");
  }
  if (tried.empty()) return not_found("{}: no library path to try", what);
  return not_found("{} could not be loaded ({}); put the directory that holds it on LD_LIBRARY_PATH", what, tried);
}

Expected<void*> SharedLibrary::symbol(const char* name) const {
  if (handle_ == nullptr) return not_found("{}: no library is loaded", name);
  ::dlerror();  // clear a stale error: a symbol's value may legitimately be null
  void* address = ::dlsym(handle_, name);
  if (const char* reason = ::dlerror(); reason != nullptr) {
    return not_found("{} has no symbol {} ({}); is it an older version than the headers tierzero was built with?",
                     path_, name, reason);
  }
  return address;
}

const Status& LazyLibrary::load() {
  std::call_once(once_, [this] {
    Expected<SharedLibrary> opened = SharedLibrary::open(what_, candidates_);
    if (!opened.ok()) {
      status_ = opened.status();
      return;
    }
    library_ = std::move(*opened);
    status_ = resolve_(library_);
  });
  return status_;
}

void SharedLibrary::reset() {
  if (handle_ != nullptr) (void)::dlclose(std::exchange(handle_, nullptr));
  path_.clear();
}

}  // namespace tz
