#include "tierzero/common/dtype.h"

namespace tz {

std::string_view dtype_name(DType type) {
  switch (type) {
    case DType::kFp32: return "fp32";
    case DType::kBf16: return "bf16";
    case DType::kFp16: return "fp16";
    case DType::kFp64: return "fp64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUint8: return "uint8";
  }
  return "unknown";
}

std::size_t dtype_bytes(DType type) {
  switch (type) {
    case DType::kFp64:
    case DType::kInt64: return 8;
    case DType::kFp32:
    case DType::kInt32: return 4;
    case DType::kBf16:
    case DType::kFp16: return 2;
    case DType::kUint8: return 1;
  }
  return 0;
}

}  // namespace tz
