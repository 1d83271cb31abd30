// make_python_store(): bindings/store.h.
#include "store.h"

#include <nanobind/stl/string.h>

#include <cstdint>
#include <string_view>
#include <vector>

namespace tzpy {
namespace {

bool says_timeout(std::string_view what) {
  return what.find("timeout") != std::string_view::npos || what.find("timed out") != std::string_view::npos ||
         what.find("Timeout") != std::string_view::npos;
}

class PythonStore final : public tz::RendezvousStore {
 public:
  PythonStore(nb::object store, std::string name) : store_(std::move(store)), name_(std::move(name)) {}
  ~PythonStore() override {
    nb::gil_scoped_acquire gil;  // the last reference may go on a thread without it
    store_.reset();
  }

  tz::Status set(const std::string& key, const std::vector<char>& value) override {
    nb::gil_scoped_acquire gil;
    try {
      store_.attr("set")(key, nb::bytes(value.data(), value.size()));
      return tz::ok_status();
    } catch (const nb::python_error& e) {
      return tz::io_error("{}: set {}: {}", name_, key, e.what());
    }
  }

  tz::Expected<std::vector<char>> get(const std::string& key, std::chrono::milliseconds timeout) override {
    nb::gil_scoped_acquire gil;
    try {
      nb::object timedelta = nb::module_::import_("datetime").attr("timedelta");
      nb::list keys;
      keys.append(key);
      store_.attr("wait")(keys, timedelta(nb::arg("milliseconds") = timeout.count()));
    } catch (const nb::python_error& e) {
      if (says_timeout(e.what())) {
        return tz::timeout_error("{}: key {} was not set within {} ms", name_, key, timeout.count());
      }
      return tz::io_error("{}: waiting for {}: {}", name_, key, e.what());
    }
    try {
      nb::bytes value = nb::cast<nb::bytes>(store_.attr("get")(key));
      const char* data = value.c_str();
      return std::vector<char>(data, data + value.size());
    } catch (const std::exception& e) {  // nb::python_error, nb::cast_error
      return tz::io_error("{}: get {}: {}", name_, key, e.what());
    }
  }

  tz::Expected<std::int64_t> add(const std::string& key, std::int64_t delta) override {
    nb::gil_scoped_acquire gil;
    try {
      return nb::cast<std::int64_t>(store_.attr("add")(key, delta));
    } catch (const std::exception& e) {
      return tz::io_error("{}: add {}: {}", name_, key, e.what());
    }
  }

  tz::Status erase(const std::string& key) override {
    nb::gil_scoped_acquire gil;
    try {
      if (nb::hasattr(store_, "delete_key")) store_.attr("delete_key")(key);
      return tz::ok_status();
    } catch (const nb::python_error& e) {
      return tz::io_error("{}: delete_key {}: {}", name_, key, e.what());
    }
  }

  std::string describe() const override { return name_; }

 private:
  nb::object store_;
  std::string name_;
};

}  // namespace

std::shared_ptr<tz::RendezvousStore> make_python_store(nb::object store, std::string name) {
  for (const char* method : {"set", "get", "wait", "add"}) {
    if (!nb::hasattr(store, method)) {
      throw nb::type_error(
          fmt::format("Engine(store=): {} has no {}() method; pass a torch.distributed Store (TCPStore, the default "
                      "store of an initialised process group)",
                      nb::str(nb::type_name(store.type())).c_str(), method)
              .c_str());
    }
  }
  return std::make_shared<PythonStore>(std::move(store), std::move(name));
}

}  // namespace tzpy
