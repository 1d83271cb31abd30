// Status -> Python exceptions, the one place where tierzero's errors become
// exceptions (STYLE.md: "exceptions only at the edge").
//
//   InvalidArgument                     ValueError
//   NotFound                            FileNotFoundError  (an OSError)
//   AlreadyExists                       FileExistsError    (an OSError)
//   PermissionDenied                    PermissionError    (an OSError)
//   IoError, NoSpace, DataCorruption    OSError
//   OutOfMemory                         MemoryError
//   Timeout                             TimeoutError       (an OSError)
//   Unavailable, FailedPrecondition,    RuntimeError
//   Internal
//
// The exception's message is the Status message, unchanged; the exception
// also carries `code` (the ErrorCode name, e.g. "NoSpace") and, for OSErrors
// from a failed system call, `errno`.
//
// Callers hold the GIL when they throw (the helpers below are called after a
// gil_scoped_release block has ended).
#pragma once

#include <nanobind/nanobind.h>

#include <utility>

#include "tierzero/common.h"

namespace tzpy {

namespace nb = nanobind;

// Sets the Python error for `status` (not OK) and throws nb::python_error.
[[noreturn]] void raise_status(const tz::Status& status);

inline void check(const tz::Status& status) {
  if (!status.ok()) raise_status(status);
}

template <typename T>
T value_or_raise(tz::Expected<T>&& expected) {
  if (!expected.ok()) raise_status(expected.status());
  return std::move(expected).value();
}

// The exception type a code maps to (a borrowed reference to a builtin).
PyObject* exception_type(tz::ErrorCode code);

void bind_errors(nb::module_& m);

}  // namespace tzpy
