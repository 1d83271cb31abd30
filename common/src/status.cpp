#include "tierzero/common/status.h"

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace tz {

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk: return "OK";
    case ErrorCode::kInvalidArgument: return "InvalidArgument";
    case ErrorCode::kNotFound: return "NotFound";
    case ErrorCode::kAlreadyExists: return "AlreadyExists";
    case ErrorCode::kOutOfMemory: return "OutOfMemory";
    case ErrorCode::kIoError: return "IoError";
    case ErrorCode::kDataCorruption: return "DataCorruption";
    case ErrorCode::kNoSpace: return "NoSpace";
    case ErrorCode::kPermissionDenied: return "PermissionDenied";
    case ErrorCode::kUnavailable: return "Unavailable";
    case ErrorCode::kFailedPrecondition: return "FailedPrecondition";
    case ErrorCode::kTimeout: return "Timeout";
    case ErrorCode::kInternal: return "Internal";
  }
  return "Unknown";
}

Status::Status(ErrorCode code, std::string message, int sys_errno) {
  if (code == ErrorCode::kOk) return;
  state_ = std::make_unique<State>(State{code, std::move(message), sys_errno, {}});
}

Status::Status(const Status& other)
    : state_(other.state_ ? std::make_unique<State>(*other.state_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) state_ = other.state_ ? std::make_unique<State>(*other.state_) : nullptr;
  return *this;
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return state_ ? state_->message : kEmpty;
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  return fmt::format("{}: {}", error_code_name(state_->code), state_->message);
}

std::string Status::debug_string() const {
  std::string out = to_string();
  if (state_) {
    for (const auto& frame : state_->frames) out += fmt::format("\n    at {}", frame);
  }
  return out;
}

Status& Status::with_context(std::string_view context) & {
  if (state_ && !context.empty()) state_->message = fmt::format("{}: {}", context, state_->message);
  return *this;
}
Status Status::with_context(std::string_view context) && { return std::move(with_context(context)); }

Status& Status::add_frame(std::source_location where) & {
  if (state_) {
    std::string_view file = where.file_name();
    if (auto slash = file.rfind('/'); slash != std::string_view::npos) file.remove_prefix(slash + 1);
    state_->frames.push_back(fmt::format("{}:{} ({})", file, where.line(), where.function_name()));
  }
  return *this;
}
Status Status::add_frame(std::source_location where) && { return std::move(add_frame(where)); }

Status errno_status(int err, std::string_view what) {
  ErrorCode code = ErrorCode::kIoError;
  switch (err) {
    case ENOENT: case ENODEV: case ENXIO: code = ErrorCode::kNotFound; break;
    case ENOSPC: case EDQUOT: code = ErrorCode::kNoSpace; break;
    case ENOMEM: code = ErrorCode::kOutOfMemory; break;
    case EACCES: case EPERM: code = ErrorCode::kPermissionDenied; break;
    case EEXIST: code = ErrorCode::kAlreadyExists; break;
    case EINVAL: code = ErrorCode::kInvalidArgument; break;
    case ENOSYS: case EOPNOTSUPP: code = ErrorCode::kUnavailable; break;
    case ETIMEDOUT: code = ErrorCode::kTimeout; break;
    default: break;
  }
  return Status(code, fmt::format("{}: {} (errno {})", what, std::strerror(err), err), err);
}

namespace detail {
void bad_expected_access(const Status& status) {
  // A programming error (value() on an error), not a run-time failure: throw so
  // it cannot be compiled away, with the error it hid.
  throw std::logic_error("Expected::value() called on an error: " + status.to_string());
}
}  // namespace detail

}  // namespace tz
