#include "tierzero/common/status.h"

#include <gtest/gtest.h>

#include <cerrno>

#include "tierzero/common/checks.h"

namespace tz {
namespace {

Expected<int> parse_positive(int v) {
  if (v <= 0) return invalid_argument("value {} is not positive", v);
  return v;
}

Status use_value(int v) {
  TZ_ASSIGN_OR_RETURN(int x, parse_positive(v));
  if (x > 100) return out_of_memory("{} > 100", x);
  return ok_status();
}

Status outer(int v) {
  TZ_TRY_CTX(use_value(v), "loading block {}", 7);
  return ok_status();
}

TEST(Status, OkIsCheapAndEmpty) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kOk);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.to_string(), "OK");
}

TEST(Status, ContextIsPrefixedAsErrorsClimb) {
  Status s = outer(-3);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "loading block 7: value -3 is not positive");
  // Two frames: use_value's TZ_ASSIGN_OR_RETURN and outer's TZ_TRY_CTX.
  std::string debug = s.debug_string();
  EXPECT_NE(debug.find("status_test.cpp"), std::string::npos) << debug;
  EXPECT_NE(debug.find("use_value"), std::string::npos) << debug;
  EXPECT_NE(debug.find("outer"), std::string::npos) << debug;
}

TEST(Status, OkPassesThroughMacros) {
  EXPECT_TRUE(outer(5).ok());
  EXPECT_EQ(outer(500).code(), ErrorCode::kOutOfMemory);
}

TEST(Status, CopiesAreDeep) {
  Status a = io_error("disk");
  Status b = a;
  b.with_context("ctx");
  EXPECT_EQ(a.message(), "disk");
  EXPECT_EQ(b.message(), "ctx: disk");
}

TEST(Status, ErrnoMapsToCodes) {
  EXPECT_EQ(errno_status(ENOSPC, "write").code(), ErrorCode::kNoSpace);
  EXPECT_EQ(errno_status(ENOENT, "open").code(), ErrorCode::kNotFound);
  EXPECT_EQ(errno_status(ENOMEM, "mlock").code(), ErrorCode::kOutOfMemory);
  EXPECT_EQ(errno_status(EPERM, "mlock").code(), ErrorCode::kPermissionDenied);
  Status eio = errno_status(EIO, "pread /x at 4096");
  EXPECT_EQ(eio.code(), ErrorCode::kIoError);
  EXPECT_EQ(eio.sys_errno(), EIO);
  EXPECT_NE(eio.message().find("pread /x at 4096"), std::string::npos);
  EXPECT_NE(eio.message().find("errno 5"), std::string::npos);
}

TEST(Expected, ValueOrError) {
  Expected<int> good = parse_positive(4);
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(*good, 4);
  Expected<int> bad = parse_positive(0);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(bad.value_or(9), 9);
  EXPECT_THROW((void)bad.value(), std::logic_error);
}

TEST(Expected, FromOkStatusIsAnInternalError) {
  Expected<int> e{Status()};
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), ErrorCode::kInternal);
}

Status failing_syscall() {
  errno = 0;
  TZ_SYSCALL_CHECK(::close(-1));
  return ok_status();
}

int g_eintr_calls = 0;
int fails_with_eintr_twice() {
  if (++g_eintr_calls <= 2) {
    errno = EINTR;
    return -1;
  }
  return 42;
}

Expected<int> retried_syscall() {
  TZ_SYSCALL(n, fails_with_eintr_twice());
  return n;
}

Status failing_uring() {
  TZ_URING_CHECK(-EAGAIN);
  return ok_status();
}

TEST(Checks, SyscallNamesTheCallAndErrno) {
  Status s = failing_syscall();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.sys_errno(), EBADF);
  EXPECT_NE(s.message().find("close(-1)"), std::string::npos) << s.message();
}

TEST(Checks, SyscallRetriesEintr) {
  g_eintr_calls = 0;
  Expected<int> r = retried_syscall();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, 42);
  EXPECT_EQ(g_eintr_calls, 3);
}

TEST(Checks, UringNegativeErrno) {
  Status s = failing_uring();
  EXPECT_EQ(s.sys_errno(), EAGAIN);
  EXPECT_NE(s.message().find("-EAGAIN"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace tz
