// Status -> Python exceptions (see errors.h for the mapping).
#include "errors.h"

#include <nanobind/stl/string.h>

#include <string>

namespace tzpy {

PyObject* exception_type(tz::ErrorCode code) {
  switch (code) {
    case tz::ErrorCode::kInvalidArgument: return PyExc_ValueError;
    case tz::ErrorCode::kNotFound: return PyExc_FileNotFoundError;
    case tz::ErrorCode::kAlreadyExists: return PyExc_FileExistsError;
    case tz::ErrorCode::kPermissionDenied: return PyExc_PermissionError;
    case tz::ErrorCode::kIoError:
    case tz::ErrorCode::kNoSpace:
    case tz::ErrorCode::kDataCorruption: return PyExc_OSError;
    case tz::ErrorCode::kOutOfMemory: return PyExc_MemoryError;
    case tz::ErrorCode::kTimeout: return PyExc_TimeoutError;
    case tz::ErrorCode::kOk:
    case tz::ErrorCode::kUnavailable:
    case tz::ErrorCode::kFailedPrecondition:
    case tz::ErrorCode::kInternal: break;
  }
  return PyExc_RuntimeError;
}

void raise_status(const tz::Status& status) {
  PyObject* type = exception_type(status.code());
  // One argument, so str(exc) is exactly the message. OSError(errno, text)
  // would prefix "[Errno N]"; errno goes in as an attribute instead.
  nb::object exc = nb::steal(PyObject_CallFunction(type, "s", status.message().c_str()));
  if (!exc.is_valid()) throw nb::python_error();
  nb::setattr(exc, "code", nb::str(std::string(tz::error_code_name(status.code())).c_str()));
  if (status.sys_errno() != 0 && PyObject_IsSubclass(type, PyExc_OSError) == 1) {
    nb::setattr(exc, "errno", nb::int_(status.sys_errno()));
  }
  PyErr_SetObject(type, exc.ptr());
  throw nb::python_error();
}

namespace {

// For tests: raises the exception a Status of `code` would, with `message`.
void raise_for_test(const std::string& code, const std::string& message, int sys_errno) {
  for (int c = 1; c <= static_cast<int>(tz::ErrorCode::kInternal); ++c) {
    const auto ec = static_cast<tz::ErrorCode>(c);
    if (tz::error_code_name(ec) == code) raise_status(tz::Status(ec, message, sys_errno));
  }
  throw nb::value_error(("no error code named '" + code + "'").c_str());
}

}  // namespace

void bind_errors(nb::module_& m) {
  m.def("_raise_status", &raise_for_test, nb::arg("code"), nb::arg("message"), nb::arg("sys_errno") = 0,
        "Raises what a tierzero Status with this code would raise (for tests).");
  nb::list codes;
  for (int c = 1; c <= static_cast<int>(tz::ErrorCode::kInternal); ++c) {
    codes.append(nb::str(std::string(tz::error_code_name(static_cast<tz::ErrorCode>(c))).c_str()));
  }
  m.attr("ERROR_CODES") = nb::tuple(codes);
}

}  // namespace tzpy
