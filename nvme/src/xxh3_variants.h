// XXH3-64 built once per instruction set: xxh3_<isa>.cpp, each compiled with
// its own flags from xxh3_impl.h. checksum.cpp runs the widest the CPU has;
// nothing else may call an x86 variant without checking the CPU first.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tz::nvme::detail {

std::uint64_t xxh3_64_scalar(const void* data, std::size_t bytes);  // portable C, any CPU
#if defined(TZ_NVME_X86)
std::uint64_t xxh3_64_sse2(const void* data, std::size_t bytes);    // every x86-64
std::uint64_t xxh3_64_avx2(const void* data, std::size_t bytes);    // AVX2
std::uint64_t xxh3_64_avx512(const void* data, std::size_t bytes);  // AVX-512F
#endif

}  // namespace tz::nvme::detail
