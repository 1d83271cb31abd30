// Checks on every input of a call, done before any memory is touched, and the
// per-call constants derived from valid hyperparameters.
#pragma once

#include <cstddef>

#include "kernel_api.h"
#include "tierzero/cpu_adam.h"

namespace tz::cpu_adam::detail {

// NaN in any field, out-of-range values for the algorithm, step < 1,
// grad_scale not finite and > 0, amsgrad where it does not apply. The message
// names the field, its value and the allowed range.
Status validate_hyper(const Hyper& hyper, const StepArgs& args);

// For n > 0: the spans the algorithm and the master format need are non-null
// and aligned to their element size, dtypes are ones the span may have, no two
// spans overlap, and a remainder-format call passes no fp32 param.
Status validate_spans(const Hyper& hyper, const Spans& spans);

// Spans::weight_decay_segments: each begin < end <= n, sorted and disjoint,
// weight_decay finite and >= 0. The message names the segment's index and
// values (and its predecessor's, when they overlap or are out of order).
// Checked for any n (with n == 0 every segment is past n).
Status validate_segments(const Spans& spans);

// For n > 0: acc and grad non-null, aligned and disjoint; a gradient dtype;
// a finite scale.
Status validate_accumulate(const void* acc, DType acc_dtype, const void* grad, DType grad_dtype, std::size_t n,
                           double scale);

// For n > 0: the arrays of encode/decode_remainder_masters non-null, aligned
// and disjoint (tie_bits: ceil(n / 8) bytes).
Status validate_master_arrays(const float* master, const void* bf16, const void* remainder, const void* tie_bits,
                              std::size_t n);

// For n > 0: the arrays of encode/decode_int8_moment non-null, aligned and
// disjoint (scales: ceil(n / 256)).
Status validate_int8_arrays(const float* x, const std::uint8_t* codes, const float* scales, std::size_t n);

// Which element loop runs (Adam without weight decay runs AdamW's: identical).
Kind kind_of(const Hyper& hyper);

// Where valid spans keep the master and what is written beside it.
ParamLayout param_layout_of(const Spans& spans);

// The fp32 constants of one step (bias corrections and Adagrad's decayed lr
// in double first). Fails when one does not fit in fp32 (lr = 1e300).
Expected<StepConsts> make_consts(const Hyper& hyper, const StepArgs& args);

}  // namespace tz::cpu_adam::detail
