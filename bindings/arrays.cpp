// Array argument checks (Note [Array arguments] in arrays.h).
#include "arrays.h"

#include <fmt/format.h>

namespace tzpy {
namespace {

constexpr int kDLCPU = 1;
constexpr int kDLCUDA = 2;
constexpr int kDLCUDAHost = 3;  // pinned host memory: CPU-addressable

bool device_ok(const ArraySpec& spec, int type, int id) {
  switch (spec.device) {
    case DeviceKind::kAny: return true;
    case DeviceKind::kCpu: return type == kDLCPU || type == kDLCUDAHost;
    case DeviceKind::kCuda: return type == kDLCUDA && (spec.device_id < 0 || spec.device_id == id);
  }
  return false;
}

std::string wanted_device(const ArraySpec& spec) {
  switch (spec.device) {
    case DeviceKind::kAny: return "any device";
    case DeviceKind::kCpu: return "cpu";
    case DeviceKind::kCuda: return spec.device_id < 0 ? "cuda" : fmt::format("cuda:{}", spec.device_id);
  }
  return "?";
}

std::string wanted_dtypes(const ArraySpec& spec) {
  std::string out;
  for (std::size_t i = 0; i < spec.dtypes.size(); ++i) {
    if (i > 0) out += i + 1 == spec.dtypes.size() ? " or " : ", ";
    out += numpy_name(spec.dtypes[i]);
  }
  return out;
}

bool c_contiguous(const nb::ndarray<nb::ro>& a) {
  // DLPack allows strides == NULL for compact row-major tensors.
  if (a.stride_ptr() == nullptr) return true;
  // No elements: no layout to get wrong (numpy gives such arrays stride 0, torch any).
  for (std::size_t i = 0; i < a.ndim(); ++i) {
    if (a.shape(i) == 0) return true;
  }
  std::int64_t expected = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<std::int64_t>(a.shape(i));
  }
  return true;
}

std::string shape_text(const nb::ndarray<nb::ro>& a) {
  std::string out = "(";
  for (std::size_t i = 0; i < a.ndim(); ++i) out += fmt::format("{}{}", i ? ", " : "", a.shape(i));
  return out + (a.ndim() == 1 ? ",)" : ")");
}

[[noreturn]] void refuse(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  throw nb::python_error();
}

}  // namespace

const char* numpy_name(DType dtype) {
  switch (dtype) {
    case DType::kFp32: return "float32";
    case DType::kBf16: return "bfloat16";
    case DType::kFp16: return "float16";
    case DType::kFp64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUint8: return "uint8";
  }
  return "?";
}

nb::dlpack::dtype dlpack_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFp32: return nb::dtype<float>();
    case DType::kBf16: return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    case DType::kFp16: return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::kFp64: return nb::dtype<double>();
    case DType::kInt32: return nb::dtype<std::int32_t>();
    case DType::kInt64: return nb::dtype<std::int64_t>();
    case DType::kUint8: break;
  }
  return nb::dtype<std::uint8_t>();
}

std::optional<DType> dtype_of(const nb::dlpack::dtype& d) {
  for (DType t : {DType::kFp32, DType::kBf16, DType::kFp16, DType::kFp64, DType::kInt32, DType::kInt64,
                  DType::kUint8}) {
    if (d == dlpack_dtype(t)) return t;
  }
  return std::nullopt;
}

std::string describe_dtype(const nb::dlpack::dtype& d) {
  const char* kind = "?";
  switch (static_cast<nb::dlpack::dtype_code>(d.code)) {
    case nb::dlpack::dtype_code::Int: kind = "int"; break;
    case nb::dlpack::dtype_code::UInt: kind = "uint"; break;
    case nb::dlpack::dtype_code::Float: kind = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: kind = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: kind = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: break;
  }
  return d.lanes > 1 ? fmt::format("{}{}x{}", kind, d.bits, d.lanes) : fmt::format("{}{}", kind, d.bits);
}

std::string describe_device(int device_type, int device_id) {
  if (device_type == kDLCPU) return "cpu";
  if (device_type == kDLCUDAHost) return "cpu (CUDA pinned)";
  if (device_type == kDLCUDA) return fmt::format("cuda:{}", device_id);
  return fmt::format("device type {}", device_type);
}

ArrayInfo check(const InArray& a, const ArraySpec& spec, const char* where, const std::string& arg) {
  const std::optional<DType> dt = dtype_of(a.dtype());
  bool dtype_ok = spec.dtypes.empty();
  for (DType want : spec.dtypes) dtype_ok = dtype_ok || want == dt;
  if (!dtype_ok) {
    refuse(PyExc_TypeError, fmt::format("{}: argument '{}' must be {}; got {}", where, arg, wanted_dtypes(spec),
                                        describe_dtype(a.dtype())));
  }
  if (!device_ok(spec, a.device_type(), a.device_id())) {
    refuse(PyExc_TypeError, fmt::format("{}: argument '{}' must be on {}; it is on {}", where, arg,
                                        wanted_device(spec), describe_device(a.device_type(), a.device_id())));
  }
  if (spec.ndim >= 0 && static_cast<int>(a.ndim()) != spec.ndim) {
    refuse(PyExc_ValueError, fmt::format("{}: argument '{}' must have {} dimension(s); got shape {}", where, arg,
                                         spec.ndim, shape_text(a)));
  }
  if (spec.contiguous && !c_contiguous(a)) {
    refuse(PyExc_ValueError,
           fmt::format("{}: argument '{}' must be C-contiguous (shape {}); pass a contiguous copy "
                       "(numpy.ascontiguousarray, tensor.contiguous())", where, arg, shape_text(a)));
  }
  ArrayInfo info;
  info.data = const_cast<void*>(a.data());
  info.numel = a.size();
  info.nbytes = a.nbytes();
  info.dtype = dt;
  info.device_type = a.device_type();
  info.device_id = a.device_id();
  return info;
}

ArrayInfo check(const OutArray& a, const ArraySpec& spec, const char* where, const std::string& arg) {
  return check(InArray(a), spec, where, arg);
}

ArrayInfo check(const WritableArg& a, const ArraySpec& spec, const char* where, const std::string& arg) {
  if (a.given.is_valid()) {
    as_array(a.given, where, arg);  // refuses it, saying why
    refuse(PyExc_TypeError, fmt::format("{}: argument '{}' must be a writable array", where, arg));
  }
  return check(a.array, spec, where, arg);
}

}  // namespace tzpy

namespace tzpy {
OutArray as_array(nb::handle obj, const char* where, const std::string& arg) {
  OutArray out;
  if (nb::try_cast(obj, out, /*convert=*/false)) return out;
  InArray read_only;
  if (nb::try_cast(obj, read_only, /*convert=*/false)) {
    refuse(PyExc_TypeError, fmt::format("{}: argument '{}' is read-only, and the call writes it; pass a writable "
                                        "array", where, arg));
  }
  refuse(PyExc_TypeError, fmt::format("{}: argument '{}' must be a writable array (numpy, torch, anything with "
                                      "__dlpack__); got {}", where, arg, nb::inst_name(obj).c_str()));
}
}  // namespace tzpy
