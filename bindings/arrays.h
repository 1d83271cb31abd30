// Arrays across the boundary: DLPack (numpy, PyTorch CPU/CUDA, CuPy, anything
// with __dlpack__ or the buffer protocol), always zero-copy.
//
// Note [Array arguments]
// Every array argument is an untyped nb::ndarray (read-only inputs as
// nb::ndarray<nb::ro>), checked here against an ArraySpec: allowed dtypes,
// dimensions, C-contiguity, device. Two reasons not to put the constraints in
// the nb::ndarray type alone:
//   - a typed nb::ndarray argument that does not match is *converted* when
//     nanobind can (a float64 numpy array becomes a float32 copy): the caller's
//     memory would silently not be the memory we update;
//   - when it cannot, the error is "incompatible function arguments" with
//     every overload's signature, not which argument is wrong or why.
// check() refuses with TypeError (dtype, device) or ValueError (shape, size,
// order) whose message names the function and the argument:
//   "CpuOptimizer.step(): argument 'grad' must be float32, bfloat16 or
//    float16; got float64"
// An untyped nb::ndarray is never converted (it accepts any DLPack array as
// it is), so what passes the check is the caller's own memory. The
// signatures' docstrings state each argument's spec, and the Python package
// (tierzero.optim, tierzero.nvme, tierzero.torch) checks again with the names
// its users know (param_groups[0]['params'][3]).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "tierzero/common/dtype.h"

namespace tzpy {

namespace nb = nanobind;

using InArray = nb::ndarray<nb::ro>;   // read by the call
using OutArray = nb::ndarray<>;        // written by the call (must be writable)
// The argument type of an array the call writes. Its caster takes any object:
// a writable array is imported (held, like any array argument, for the whole
// call), anything else is kept as given so that check() can name the
// argument and say what is wrong (read-only, or not an array); as an OutArray
// argument nanobind would refuse it with "incompatible function arguments".
// The stubs show it as an OutArray.
struct WritableArg {
  OutArray array;    // valid when `given` was a writable array
  nb::object given;  // set when it was not
};
// Returned views of tierzero's memory: an object with __dlpack__ and
// __dlpack_device__ (and the buffer protocol on CPU), so torch.from_dlpack,
// numpy.from_dlpack, cupy.from_dlpack take it without a copy, whatever the
// device or dtype (numpy has no bfloat16 and no CUDA memory).
using ExportArray = nb::ndarray<nb::array_api>;

// Element types are tz::DType (tierzero/common/dtype.h); Python names them as
// numpy and torch do ("float32", "bfloat16", ...).
using tz::DType;
const char* numpy_name(DType dtype);
nb::dlpack::dtype dlpack_dtype(DType dtype);
// The DType of an array; none when it is not one tierzero has.
std::optional<DType> dtype_of(const nb::dlpack::dtype& dtype);
std::string describe_dtype(const nb::dlpack::dtype& dtype);  // "float64", "int32", ...

enum class DeviceKind : std::uint8_t { kCpu, kCuda, kAny };

struct ArraySpec {
  std::vector<DType> dtypes;       // allowed; empty: any
  int ndim = -1;                   // -1: any
  bool contiguous = true;          // C order (any shape with contiguous elements)
  DeviceKind device = DeviceKind::kCpu;
  int device_id = -1;              // kCuda: which GPU (-1: any)
};

// The checked facts about an array argument.
struct ArrayInfo {
  void* data = nullptr;
  std::size_t numel = 0;
  std::size_t nbytes = 0;
  std::optional<DType> dtype;      // none: a dtype tierzero has no name for (allowed where any is)
  int device_type = 1;             // DLPack device type (1 CPU, 2 CUDA)
  int device_id = 0;
};

// Refuses `a` (TypeError / ValueError naming `where` and `arg`) unless it fits
// `spec`. `where` is the call ("CpuOptimizer.step()").
ArrayInfo check(const InArray& a, const ArraySpec& spec, const char* where, const std::string& arg);
ArrayInfo check(const OutArray& a, const ArraySpec& spec, const char* where, const std::string& arg);
// The same for an array the call writes: also TypeError when it is read-only
// or not an array.
ArrayInfo check(const WritableArg& a, const ArraySpec& spec, const char* where, const std::string& arg);

// "cpu" / "cuda:1" / "device type 8".
std::string describe_device(int device_type, int device_id);

}  // namespace tzpy

namespace tzpy {
// `obj` as a writable array (anything DLPack or buffer-protocol, never
// copied), or TypeError naming `where` and `arg`, and saying whether it is
// read-only or not an array at all.
OutArray as_array(nb::handle obj, const char* where, const std::string& arg);
}  // namespace tzpy

namespace nanobind::detail {
template <>
struct type_caster<tzpy::WritableArg> {
  NB_TYPE_CASTER(tzpy::WritableArg, type_caster<tzpy::OutArray>::Name)
  bool from_python(handle src, uint32_t, cleanup_list*) noexcept {
    if (src.is_none()) return false;  // std::optional<WritableArg> takes None itself
    if (!nanobind::try_cast(src, value.array, /*convert=*/false)) value.given = borrow(src);
    return true;
  }
  static handle from_cpp(const tzpy::WritableArg& v, rv_policy policy, cleanup_list* cleanup) noexcept {
    if (v.given.is_valid()) return v.given.inc_ref();
    return make_caster<tzpy::OutArray>::from_cpp(v.array, policy, cleanup);
  }
};
}  // namespace nanobind::detail
