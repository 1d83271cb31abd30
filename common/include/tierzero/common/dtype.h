// DType: the element types tierzero stores, moves and computes on, for every
// module (the states' and gradients' types, collectives' element types, the
// optimizer kernels' and the CUDA kernels' formats).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tz {

enum class DType : std::uint8_t { kFp32, kBf16, kFp16, kFp64, kInt32, kInt64, kUint8 };

// "fp32" | "bf16" | "fp16" | "fp64" | "int32" | "int64" | "uint8".
std::string_view dtype_name(DType type);
std::size_t dtype_bytes(DType type);

}  // namespace tz
