// tierzero-adam-bench's remainder-master conversions: how fast an fp32 master
// splits into bf16 + remainder + tie bit (encode_remainder_masters: the engine
// runs it once per shard when it creates remainder masters from fp32 ones) and
// joins back (decode_remainder_masters: the fp32 export and checkpoints in the
// fp32 format). On every core, as the engine calls them.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <vector>

#include "bench_common.h"
#include "tierzero/common.h"

namespace tzbench::adam {

struct ConversionRow {
  std::size_t n = 0;  // elements converted per repetition (the size, capped: kConversionCap)
  PairedTimes times;  // a: encode, b: decode
};

// Times `repeats` encode/decode pairs (after one warm-up) over min(size, cap)
// random masters and checks that every decode rebuilt the masters bit for bit.
tz::Status measure_conversions(std::size_t size, int repeats, std::vector<ConversionRow>& out);

// The conversions table; returns its JSON.
nlohmann::json print_conversions(const std::vector<ConversionRow>& rows);

}  // namespace tzbench::adam
