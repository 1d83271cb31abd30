// Status and Expected<T>: how every tierzero function reports failure.
//
// A Status is either OK or carries an ErrorCode, a message, an optional errno,
// and a list of call sites it passed through on the way up. Messages gain
// context as they climb (`TZ_TRY_CTX` prefixes "what we were doing: "), so the
// error a user sees reads like
//
//   opening swap file /nvme0/tz.swap: open: No such file or directory (errno 2)
//
// and `debug_string()` adds the call sites for the logs.
//
// Example:
//
//   tz::Expected<size_t> read_header(int fd);
//
//   tz::Status load(int fd) {
//     TZ_ASSIGN_OR_RETURN(size_t n, read_header(fd));
//     TZ_TRY_CTX(check(n), "validating header of {} bytes", n);
//     return tz::ok_status();
//   }
//
// Both types are [[nodiscard]]: ignoring an error is a compile warning.
// Thread safety: values, no shared state; safe to move across threads.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <source_location>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace tz {

enum class ErrorCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument,     // the caller (or the config) asked for something impossible
  kNotFound,            // a file, path, key or device that is not there
  kAlreadyExists,
  kOutOfMemory,         // a tier budget or the system ran out
  kIoError,             // a read, write or sync failed
  kDataCorruption,      // a checksum or header did not match
  kNoSpace,             // ENOSPC
  kPermissionDenied,
  kUnavailable,         // a capability is missing (no GPU, io_uring refused)
  kFailedPrecondition,  // called in the wrong state
  kTimeout,
  kInternal,            // a bug in tierzero
};

std::string_view error_code_name(ErrorCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(ErrorCode code, std::string message, int sys_errno = 0);

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  bool ok() const { return state_ == nullptr; }
  explicit operator bool() const { return ok(); }
  ErrorCode code() const { return state_ ? state_->code : ErrorCode::kOk; }
  // The user-facing message, with every context prefix added on the way up.
  const std::string& message() const;
  // errno of the failed system call, 0 if none.
  int sys_errno() const { return state_ ? state_->sys_errno : 0; }
  // "IoError: <message>".
  std::string to_string() const;
  // to_string() plus the call sites the error passed through, innermost first.
  std::string debug_string() const;

  // Prefixes "context: " to the message. No-op on OK. The rvalue forms return
  // by value, so `auto&& s = f().with_context(...)` (as TZ_TRY binds it) owns
  // its Status instead of naming a temporary that dies at the semicolon.
  Status& with_context(std::string_view context) &;
  Status with_context(std::string_view context) &&;
  // Records a call site (used by the TZ_TRY macros). No-op on OK.
  Status& add_frame(std::source_location where) &;
  Status add_frame(std::source_location where) &&;

  // Marks the status as looked at, for code that really means to drop an error.
  void ignore_error() const {}

 private:
  struct State {
    ErrorCode code;
    std::string message;
    int sys_errno;
    std::vector<std::string> frames;
  };
  std::unique_ptr<State> state_;
};

inline Status ok_status() { return Status(); }

// Constructors for each code, with fmt-style formatting:
//   return tz::invalid_argument("queue_depth {} out of range [1, {}]", qd, kMax);
#define TZ_DEFINE_STATUS_FACTORY(fn, code)                                  \
  template <typename... Args>                                               \
  Status fn(fmt::format_string<Args...> format, Args&&... args) {           \
    return Status(code, fmt::format(format, std::forward<Args>(args)...));  \
  }
TZ_DEFINE_STATUS_FACTORY(invalid_argument, ErrorCode::kInvalidArgument)
TZ_DEFINE_STATUS_FACTORY(not_found, ErrorCode::kNotFound)
TZ_DEFINE_STATUS_FACTORY(already_exists, ErrorCode::kAlreadyExists)
TZ_DEFINE_STATUS_FACTORY(out_of_memory, ErrorCode::kOutOfMemory)
TZ_DEFINE_STATUS_FACTORY(io_error, ErrorCode::kIoError)
TZ_DEFINE_STATUS_FACTORY(data_corruption, ErrorCode::kDataCorruption)
TZ_DEFINE_STATUS_FACTORY(unavailable, ErrorCode::kUnavailable)
TZ_DEFINE_STATUS_FACTORY(failed_precondition, ErrorCode::kFailedPrecondition)
TZ_DEFINE_STATUS_FACTORY(timeout_error, ErrorCode::kTimeout)
TZ_DEFINE_STATUS_FACTORY(internal_error, ErrorCode::kInternal)
#undef TZ_DEFINE_STATUS_FACTORY

// A Status from an errno value: the code follows the errno (ENOENT -> NotFound,
// ENOSPC -> NoSpace, ENOMEM -> OutOfMemory, EACCES/EPERM -> PermissionDenied,
// anything else -> IoError) and the message ends in "<strerror> (errno N)".
Status errno_status(int err, std::string_view what);

// Expected<T>: a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Expected {
  static_assert(!std::is_same_v<std::decay_t<T>, Status>, "use Status directly");

 public:
  Expected(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Expected(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).ok()) {
      v_ = Status(ErrorCode::kInternal, "Expected<T> constructed from an OK Status");
    }
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return ok(); }

  // Precondition: ok(). Calling these on an error is a bug (checked: throws).
  T& value() & { return check_ok(), std::get<T>(v_); }
  const T& value() const& { return check_ok(), std::get<T>(v_); }
  T&& value() && { return check_ok(), std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  // The error; OK status when ok().
  Status status() const& { return ok() ? Status() : std::get<Status>(v_); }
  Status status() && { return ok() ? Status() : std::get<Status>(std::move(v_)); }

  T value_or(T fallback) const& { return ok() ? std::get<T>(v_) : std::move(fallback); }

 private:
  void check_ok() const;
  std::variant<T, Status> v_;
};

namespace detail {
[[noreturn]] void bad_expected_access(const Status& status);
inline Status&& to_status(Status&& s) { return std::move(s); }
inline Status to_status(const Status& s) { return s; }
template <typename T>
Status to_status(Expected<T>&& e) { return std::move(e).status(); }
}  // namespace detail

template <typename T>
void Expected<T>::check_ok() const {
  if (!ok()) detail::bad_expected_access(std::get<Status>(v_));
}

}  // namespace tz

#define TZ_CONCAT_INNER_(a, b) a##b
#define TZ_CONCAT_(a, b) TZ_CONCAT_INNER_(a, b)

// Returns the error (Status or Expected's error) from the enclosing function,
// recording this call site.
#define TZ_TRY(expr)                                                          \
  do {                                                                        \
    auto&& tz_try_result_ = (expr);                                           \
    if (!tz_try_result_.ok()) {                                               \
      return ::tz::detail::to_status(std::move(tz_try_result_))               \
          .add_frame(std::source_location::current());                        \
    }                                                                         \
  } while (0)

// As TZ_TRY, and prefixes fmt-formatted context to the message.
#define TZ_TRY_CTX(expr, ...)                                                 \
  do {                                                                        \
    auto&& tz_try_result_ = (expr);                                           \
    if (!tz_try_result_.ok()) {                                               \
      return ::tz::detail::to_status(std::move(tz_try_result_))               \
          .with_context(::fmt::format(__VA_ARGS__))                           \
          .add_frame(std::source_location::current());                        \
    }                                                                         \
  } while (0)

// TZ_ASSIGN_OR_RETURN(auto x, expected_expr): declares/assigns the value or
// returns the error. It expands to several statements: brace it when it is
// the body of an if.
#define TZ_ASSIGN_OR_RETURN(lhs, expr) \
  TZ_ASSIGN_OR_RETURN_IMPL_(TZ_CONCAT_(tz_expected_, __LINE__), lhs, expr)
#define TZ_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr)                             \
  auto tmp = (expr);                                                          \
  if (!tmp.ok()) {                                                            \
    return std::move(tmp).status().add_frame(std::source_location::current()); \
  }                                                                           \
  lhs = std::move(tmp).value()
