// The extension module tierzero._core: one bind_* per bindings/x.cpp, each
// tested by tests/python/test_x.py. The Python package (bindings/tierzero)
// is the interface users see; this module is its engine room.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "errors.h"
#include "tierzero/engine.h"

namespace tzpy {
void bind_probe(nb::module_& m);
void bind_planner(nb::module_& m);
void bind_units(nb::module_& m);
void bind_cpu_adam(nb::module_& m);
void bind_nvme(nb::module_& m);
void bind_engine(nb::module_& m);
}  // namespace tzpy

NB_MODULE(_core, m) {
  namespace nb = nanobind;
  m.doc() = "tierzero's C++ core: capability probe, planner, CPU optimizers, NVMe tier, ZeRO engine.";
  m.attr("__version__") = TIERZERO_VERSION;
  // An Engine referenced from a torch model's hooks (tierzero.torch) that is
  // still alive when the interpreter exits is not collected by Python's
  // shutdown, and nanobind would report it as a leak. Real leaks are tested
  // instead (tests/python/test_torch.py: a dropped engine is collected).
  nb::set_leak_warnings(false);
  m.def("build_summary", &tz::build_summary, "Version, CUDA on/off and architectures, build type.");
  m.def(
      "set_log_level",
      [](const std::string& spec) {
        if (!tz::log::configure(spec)) {
          tzpy::raise_status(tz::invalid_argument("log spec '{}': expected e.g. 'debug' or 'warn,nvme=trace' "
                                                  "(levels: trace, debug, info, warn, error, off)", spec));
        }
      },
      nb::arg("spec"), "Replaces the TIERZERO_LOG setting (logs go to stderr).");
  tzpy::bind_errors(m);
  tzpy::bind_probe(m);
  tzpy::bind_planner(m);
  tzpy::bind_units(m);
  tzpy::bind_cpu_adam(m);
  tzpy::bind_nvme(m);
  tzpy::bind_engine(m);
}
