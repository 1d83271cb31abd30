#include "reduce.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "tierzero/kernels.h"

namespace tz::comm_detail {
namespace {

// How a stored element becomes a value to compute with, and back. The 16-bit
// formats use the same conversions as the rest of tierzero (tz::kernels), so
// a bf16 sum here rounds exactly as a cast there does.
template <typename T>
struct Native {
  using Storage = T;
  using Value = T;
  static T load(T v) { return v; }
  static T store(T v) { return v; }
};
struct Bf16 {
  using Storage = std::uint16_t;
  using Value = float;
  static float load(std::uint16_t v) { return kernels::bf16_to_fp32(v); }
  static std::uint16_t store(float v) { return kernels::fp32_to_bf16(v); }
};
struct Fp16 {
  using Storage = std::uint16_t;
  using Value = float;
  static float load(std::uint16_t v) { return kernels::fp16_to_fp32(v); }
  static std::uint16_t store(float v) { return kernels::fp32_to_fp16(v); }
};

// Integer sums wrap instead of overflowing (signed overflow is undefined).
template <typename V>
V add(V a, V b) {
  if constexpr (std::is_integral_v<V>) {
    using U = std::make_unsigned_t<V>;
    return static_cast<V>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

template <typename V>
bool is_nan(V v) {
  if constexpr (std::is_floating_point_v<V>) {
    return std::isnan(v);
  } else {
    return false;
  }
}

template <typename Codec>
void sum(void* out, const void* a, const void* b, std::size_t n) {
  using S = typename Codec::Storage;
  auto* o = static_cast<S*>(out);
  const auto* x = static_cast<const S*>(a);
  const auto* y = static_cast<const S*>(b);
  for (std::size_t i = 0; i < n; ++i) o[i] = Codec::store(add(Codec::load(x[i]), Codec::load(y[i])));
}

// Max and min copy the chosen input's bits, so nothing is rounded; a NaN
// input is chosen over a number.
template <typename Codec, bool kMax>
void select(void* out, const void* a, const void* b, std::size_t n) {
  using S = typename Codec::Storage;
  auto* o = static_cast<S*>(out);
  const auto* x = static_cast<const S*>(a);
  const auto* y = static_cast<const S*>(b);
  for (std::size_t i = 0; i < n; ++i) {
    const auto vx = Codec::load(x[i]);
    const auto vy = Codec::load(y[i]);
    const bool take_x = is_nan(vx) || (kMax ? vx > vy : vx < vy);
    o[i] = take_x ? x[i] : y[i];
  }
}

template <typename Codec>
ReduceFn for_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return &sum<Codec>;
    case ReduceOp::kMax: return &select<Codec, true>;
    case ReduceOp::kMin: return &select<Codec, false>;
  }
  return nullptr;
}

}  // namespace

ReduceFn reduce_function(DType type, ReduceOp op) {
  switch (type) {
    case DType::kFp32: return for_op<Native<float>>(op);
    case DType::kBf16: return for_op<Bf16>(op);
    case DType::kFp16: return for_op<Fp16>(op);
    case DType::kFp64: return for_op<Native<double>>(op);
    case DType::kInt32: return for_op<Native<std::int32_t>>(op);
    case DType::kInt64: return for_op<Native<std::int64_t>>(op);
    case DType::kUint8: return for_op<Native<std::uint8_t>>(op);
  }
  return nullptr;
}

}  // namespace tz::comm_detail
