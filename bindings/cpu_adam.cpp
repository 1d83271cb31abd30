// tierzero._core.CpuOptimizer: the SIMD CPU optimizers (tierzero/cpu_adam.h)
// on caller arrays, zero-copy. tierzero.optim builds torch.optim optimizers on it.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "arrays.h"
#include "errors.h"
#include "tierzero/cpu_adam.h"

namespace tzpy {
namespace {

namespace ca = tz::cpu_adam;

const ArraySpec kFp32{{DType::kFp32}};
const ArraySpec kGrad{{DType::kFp32, DType::kBf16, DType::kFp16}};
const ArraySpec kMoment{{DType::kFp32, DType::kBf16}};
const ArraySpec kHalf{{DType::kBf16, DType::kFp16}};
const ArraySpec kBf16{{DType::kBf16}};
const ArraySpec kBytes{{DType::kUint8}};

// One state array: checked, and its element count matched against the param's.
void* state(const std::optional<WritableArg>& a, const ArraySpec& spec, const char* arg, std::size_t n,
            DType* dtype = nullptr) {
  if (!a) return nullptr;
  const ArrayInfo info = check(*a, spec, "CpuOptimizer.step()", arg);
  if (info.numel != n) {
    PyErr_SetString(PyExc_ValueError, fmt::format("CpuOptimizer.step(): argument '{}' has {} elements; 'param' has {}",
                                                  arg, info.numel, n).c_str());
    throw nb::python_error();
  }
  if (dtype) *dtype = *info.dtype;  // one of spec.dtypes
  return info.data;
}

class PyCpuOptimizer {
 public:
  PyCpuOptimizer(int threads, std::optional<std::string> simd, std::size_t tile_elems) {
    ca::Options o{.threads = threads, .tile_elems = tile_elems};
    if (simd) o.simd = value_or_raise(ca::parse_simd(*simd));
    tz::Expected<std::unique_ptr<ca::CpuOptimizer>> opt = [&] {
      nb::gil_scoped_release release;
      return ca::CpuOptimizer::create(o);
    }();
    opt_ = value_or_raise(std::move(opt));
  }

  void step(const ca::Hyper& hyper, std::int64_t step, double grad_scale, const WritableArg& param,
            const InArray& grad, const std::optional<WritableArg>& exp_avg,
            const std::optional<WritableArg>& exp_avg_sq, const std::optional<WritableArg>& max_exp_avg_sq,
            const std::optional<WritableArg>& param16, const std::optional<WritableArg>& remainder,
            const std::vector<std::tuple<std::size_t, std::size_t, double>>& weight_decay_segments) {
    // Note [Remainder masters]: with `remainder`, param is the bf16 parameter and the master's bf16 part.
    const bool rem = remainder.has_value();
    const ArrayInfo p = check(param, rem ? kBf16 : kFp32, "CpuOptimizer.step()", "param");
    const ArrayInfo g = check(grad, kGrad, "CpuOptimizer.step()", "grad");
    if (g.numel != p.numel) {
      PyErr_SetString(PyExc_ValueError,
                      fmt::format("CpuOptimizer.step(): argument 'grad' has {} elements; 'param' has {}", g.numel,
                                  p.numel).c_str());
      throw nb::python_error();
    }
    ca::Spans s{.n = p.numel, .param = rem ? nullptr : static_cast<float*>(p.data), .grad = g.data,
                .grad_dtype = *g.dtype};
    if (rem) {
      if (param16) {
        PyErr_SetString(PyExc_ValueError, "CpuOptimizer.step(): 'param16' with 'remainder': the bf16 'param' is the "
                                          "parameter the step writes; there is no other copy-out");
        throw nb::python_error();
      }
      // One uint8 array: n int16 remainders, then ceil(n / 8) tie-bit bytes (tz::master_bytes(kRemainder, n)).
      const ArrayInfo r = check(*remainder, kBytes, "CpuOptimizer.step()", "remainder");
      const std::uint64_t want = tz::master_bytes(tz::MasterFormat::kRemainder, p.numel);
      if (r.numel != want) {
        PyErr_SetString(PyExc_ValueError,
                        fmt::format("CpuOptimizer.step(): argument 'remainder' has {} bytes; a remainder master of "
                                    "{} elements takes 2 x {} + ceil({} / 8) = {}",
                                    r.numel, p.numel, p.numel, p.numel, want).c_str());
        throw nb::python_error();
      }
      s.master_format = tz::MasterFormat::kRemainder;
      s.param16 = p.data;
      s.param16_dtype = DType::kBf16;
      s.remainder = static_cast<std::int16_t*>(r.data);
      s.tie_bits = static_cast<std::uint8_t*>(r.data) + 2 * p.numel;
    }
    DType m_dtype = DType::kFp32, v_dtype = DType::kFp32, h_dtype = DType::kBf16;
    s.exp_avg = state(exp_avg, kMoment, "exp_avg", p.numel, &m_dtype);
    s.exp_avg_sq = state(exp_avg_sq, kMoment, "exp_avg_sq", p.numel, &v_dtype);
    if (s.exp_avg && s.exp_avg_sq && m_dtype != v_dtype) {
      PyErr_SetString(PyExc_TypeError, "CpuOptimizer.step(): 'exp_avg' and 'exp_avg_sq' must have the same dtype");
      throw nb::python_error();
    }
    s.moment_dtype = s.exp_avg ? m_dtype : v_dtype;
    s.max_exp_avg_sq = static_cast<float*>(state(max_exp_avg_sq, kFp32, "max_exp_avg_sq", p.numel));
    if (!rem) {
      s.param16 = state(param16, kHalf, "param16", p.numel, &h_dtype);
      s.param16_dtype = h_dtype;
    }
    std::vector<ca::WeightDecaySegment> segments;
    segments.reserve(weight_decay_segments.size());
    for (const auto& [begin, end, wd] : weight_decay_segments) segments.push_back({begin, end, wd});
    s.weight_decay_segments = segments;
    tz::Status status;
    {
      nb::gil_scoped_release release;
      status = opt_->step(hyper, {.step = step, .grad_scale = grad_scale}, s);
    }
    check_status(status);
  }

  nb::tuple accumulate_grad(const WritableArg& acc, const InArray& grad, bool overwrite, double scale) {
    const ArrayInfo a = check(acc, kFp32, "CpuOptimizer.accumulate_grad()", "acc");
    const ArrayInfo g = check(grad, kGrad, "CpuOptimizer.accumulate_grad()", "grad");
    if (a.numel != g.numel) {
      PyErr_SetString(PyExc_ValueError, fmt::format("CpuOptimizer.accumulate_grad(): 'grad' has {} elements; 'acc' "
                                                    "has {}", g.numel, a.numel).c_str());
      throw nb::python_error();
    }
    tz::Expected<ca::GradStats> stats = [&] {
      nb::gil_scoped_release release;
      return opt_->accumulate_grad(static_cast<float*>(a.data), g.data, *g.dtype, a.numel, overwrite,
                                   scale);
    }();
    const ca::GradStats s = value_or_raise(std::move(stats));
    return nb::make_tuple(s.sum_squares, s.non_finite);
  }

  std::string simd() const { return std::string(ca::simd_name(opt_->simd())); }
  int threads() const { return opt_->threads(); }

 private:
  static void check_status(const tz::Status& s) { tzpy::check(s); }
  std::unique_ptr<ca::CpuOptimizer> opt_;
};

void bind_hyper(nb::module_& m) {
  nb::enum_<ca::Algorithm>(m, "Algorithm")
      .value("Adam", ca::Algorithm::kAdam)
      .value("AdamW", ca::Algorithm::kAdamW)
      .value("Adagrad", ca::Algorithm::kAdagrad)
      .value("Lion", ca::Algorithm::kLion);
  nb::class_<ca::Hyper>(m, "Hyper", "Hyperparameters of one optimizer step (tierzero/cpu_adam.h gives the formulas).")
      .def(
          "__init__",
          [](ca::Hyper* h, ca::Algorithm algorithm, double lr, double beta1, double beta2, double eps,
             double weight_decay, bool amsgrad, double lr_decay) {
            new (h) ca::Hyper{algorithm, lr, beta1, beta2, eps, weight_decay, amsgrad, lr_decay};
          },
          nb::arg("algorithm") = ca::Algorithm::kAdamW, nb::arg("lr") = 1e-3, nb::arg("beta1") = 0.9,
          nb::arg("beta2") = 0.999, nb::arg("eps") = 1e-8, nb::arg("weight_decay") = 0.0, nb::arg("amsgrad") = false,
          nb::arg("lr_decay") = 0.0)
      .def_rw("algorithm", &ca::Hyper::algorithm)
      .def_rw("lr", &ca::Hyper::lr)
      .def_rw("beta1", &ca::Hyper::beta1)
      .def_rw("beta2", &ca::Hyper::beta2)
      .def_rw("eps", &ca::Hyper::eps)
      .def_rw("weight_decay", &ca::Hyper::weight_decay)
      .def_rw("amsgrad", &ca::Hyper::amsgrad)
      .def_rw("lr_decay", &ca::Hyper::lr_decay);
}

}  // namespace

void bind_cpu_adam(nb::module_& m) {
  bind_hyper(m);
  nb::class_<PyCpuOptimizer>(m, "CpuOptimizer",
                             "The SIMD CPU optimizers (Adam, AdamW, Adagrad, Lion) over caller arrays, in place and "
                             "zero-copy. Thread-safe; calls release the GIL.")
      .def(nb::init<int, std::optional<std::string>, std::size_t>(), nb::arg("threads") = 0,
           nb::arg("simd") = nb::none(), nb::arg("tile_elems") = 0,
           "threads=0: every CPU of the NUMA node; simd: 'avx512' | 'avx2' | 'sse4.2' | 'scalar' (default: the "
           "widest this CPU runs, or $TIERZERO_SIMD).")
      .def("step", &PyCpuOptimizer::step, nb::arg("hyper"), nb::arg("step"), nb::arg("grad_scale"),
           nb::arg("param"), nb::arg("grad"), nb::arg("exp_avg") = nb::none(), nb::arg("exp_avg_sq") = nb::none(),
           nb::arg("max_exp_avg_sq") = nb::none(), nb::arg("param16") = nb::none(), nb::arg("remainder") = nb::none(),
           nb::arg("weight_decay_segments") = std::vector<std::tuple<std::size_t, std::size_t, double>>{},
           "One step in place. param: float32, C-contiguous, cpu, n elements (updated); grad: float32 | bfloat16 | "
           "float16, n elements; exp_avg, exp_avg_sq: float32 | bfloat16 (same dtype), n elements; max_exp_avg_sq: "
           "float32 (amsgrad); param16: bfloat16 | float16, receives the new param rounded (the fused copy-out); "
           "remainder: uint8, 2n + ceil(n / 8) bytes, makes param the bfloat16 parameter of a remainder master "
           "(the fp32 master rebuilt from both, bit for bit; tierzero/cpu_adam.h); weight_decay_segments: "
           "[(begin, end, weight_decay), ...], sorted and disjoint element runs that step with their own weight "
           "decay (the others with hyper.weight_decay). "
           "Which states an algorithm needs: tierzero/cpu_adam.h. Arrays of any shape with n contiguous elements.")
      .def("accumulate_grad", &PyCpuOptimizer::accumulate_grad, nb::arg("acc"), nb::arg("grad"),
           nb::arg("overwrite") = false, nb::arg("scale") = 1.0,
           "acc = (0 if overwrite else acc) + scale * grad; returns (sum of squares of acc, any non-finite). "
           "acc: float32 cpu; grad: float32 | bfloat16 | float16 cpu; same element count.")
      .def_prop_ro("simd", &PyCpuOptimizer::simd, "The SIMD variant in use.")
      .def_prop_ro("threads", &PyCpuOptimizer::threads);
  m.def(
      "simd_variants",
      [] {
        std::vector<std::string> out;
        for (ca::Simd s : ca::compiled_variants()) {
          if (ca::cpu_supports(s)) out.emplace_back(ca::simd_name(s));
        }
        return out;
      },
      "The SIMD variants compiled in that this CPU runs, narrowest first.");
}

}  // namespace tzpy
