// A shared library opened at run time (dlopen), for the foreign libraries a
// program needs only on some paths: cuBLAS and NCCL, which a CPU-only run must
// not load (Note [CUDA libraries load on first use] in common/src/shared_library.cpp).
//
//   TZ_ASSIGN_OR_RETURN(tz::SharedLibrary lib,
//                       tz::SharedLibrary::open("NCCL", {"libnccl.so.2", "/usr/local/cuda/lib/libnccl.so.2"}));
//   TZ_ASSIGN_OR_RETURN(void* fn, lib.symbol("ncclGetVersion"));
//
// open() tries each candidate in order (a bare name goes through the dynamic
// linker's search: LD_LIBRARY_PATH, the cache, the system directories; a path
// is taken as it is) and keeps the first that loads. Its error names `what`,
// every candidate and the loader's reason for each. symbol()'s error names
// the library and the symbol. A library once loaded stays mapped for the rest
// of the process (RTLD_NODELETE: NCCL's threads may outlive their handle);
// destruction only drops the handle. Thread safety: open() and symbol() may be
// called from any thread.
//
// LazyLibrary opens one library on the first load() and resolves its entry
// points into function pointers; TZ_FORWARD_LAZY defines a function under the
// vendor's name that forwards to one of them (the stub files of Note [CUDA
// libraries load on first use]).
#pragma once

#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tierzero/common/status.h"

namespace tz {

class SharedLibrary {
 public:
  SharedLibrary() = default;
  ~SharedLibrary() { reset(); }
  SharedLibrary(SharedLibrary&& other) noexcept
      : handle_(std::exchange(other.handle_, nullptr)), path_(std::move(other.path_)) {}
  SharedLibrary& operator=(SharedLibrary&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
      path_ = std::move(other.path_);
    }
    return *this;
  }
  SharedLibrary(const SharedLibrary&) = delete;
  SharedLibrary& operator=(const SharedLibrary&) = delete;

  // NotFound when no candidate loads (or none is given).
  static Expected<SharedLibrary> open(std::string_view what, const std::vector<std::string>& candidates);

  // The address of `name`; NotFound names the library and the symbol.
  Expected<void*> symbol(const char* name) const;

  bool loaded() const { return handle_ != nullptr; }
  // The candidate that loaded, as given to open().
  const std::string& path() const { return path_; }
  void reset();

 private:
  void* handle_ = nullptr;
  std::string path_;
};

// Points `slot` at `name` in `lib`; the error names both.
template <typename Fn>
Status resolve_symbol(const SharedLibrary& lib, const char* name, Fn*& slot) {
  TZ_ASSIGN_OR_RETURN(void* address, lib.symbol(name));
  slot = reinterpret_cast<Fn*>(address);
  return ok_status();
}

// A library loaded once, on the first load(), by `resolve` (which fills the
// caller's function pointers with resolve_symbol). Every load() returns the
// first one's result: a library that failed to load is not tried again.
// Meant to be a function-local static (see the stub files).
class LazyLibrary {
 public:
  using Resolve = std::function<Status(const SharedLibrary&)>;
  LazyLibrary(std::string what, std::vector<std::string> candidates, Resolve resolve)
      : what_(std::move(what)), candidates_(std::move(candidates)), resolve_(std::move(resolve)) {}
  // A vendor library by its soname ("libnccl.so.2"): through the dynamic
  // linker's search first (LD_LIBRARY_PATH, the machine's own copy), then in
  // `build_dir`, where the build found it.
  LazyLibrary(std::string what, const std::string& soname, const std::string& build_dir, Resolve resolve)
      : LazyLibrary(std::move(what), {soname, build_dir + "/" + soname}, std::move(resolve)) {}

  // Thread-safe; after the first call, one atomic load.
  const Status& load();
  const std::string& path() const { return library_.path(); }

 private:
  std::string what_;
  std::vector<std::string> candidates_;
  Resolve resolve_;
  std::once_flag once_;
  Status status_;
  SharedLibrary library_;
};

}  // namespace tz

// The stub files list a library's entry points as an X-macro whose entries
// are X(return type, name, (parameters), (arguments), value when not loaded).
// TZ_LAZY_API(Api, ENTRY_POINTS) declares `struct Api` with one function
// pointer per entry point, named as the function and typed by the vendor's
// declaration, and `Status Api::resolve(const SharedLibrary&)` pointing each
// at its symbol.
#define TZ_LAZY_SLOT_(ret, name, params, args, failed) decltype(&::name) name = nullptr;
#define TZ_LAZY_RESOLVE_(ret, name, params, args, failed) TZ_TRY(::tz::resolve_symbol(lib, #name, name));
#define TZ_LAZY_API(Api, ENTRY_POINTS)                         \
  struct Api {                                                 \
    ENTRY_POINTS(TZ_LAZY_SLOT_)                                \
    ::tz::Status resolve(const ::tz::SharedLibrary& lib) {     \
      ENTRY_POINTS(TZ_LAZY_RESOLVE_)                           \
      return ::tz::ok_status();                                \
    }                                                          \
  }

// Defines `name` (declared by its vendor header: the definition must match
// it) to call `api.name` once `library.load()` succeeded, and to return
// `failed` without calling anything when it did not.
#define TZ_FORWARD_LAZY(library, api, failed, ret, name, params, args) \
  ret name params {                                                     \
    if (!(library).load().ok()) return failed;                          \
    return (api).name args;                                             \
  }
