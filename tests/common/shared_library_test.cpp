#include "tierzero/common/shared_library.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace tz {
namespace {

// libm is in every process already; opening it again only adds a reference.
constexpr const char* kLibm = "libm.so.6";
constexpr const char* kMissing = "libtierzero-no-such-library.so.9";

TEST(SharedLibrary, KeepsTheFirstCandidateThatLoads) {
  Expected<SharedLibrary> lib = SharedLibrary::open("libm", {kMissing, kLibm});
  ASSERT_TRUE(lib.ok()) << lib.status().to_string();
  EXPECT_TRUE(lib->loaded());
  EXPECT_EQ(lib->path(), kLibm);
  double (*cosine)(double) = nullptr;
  ASSERT_TRUE(resolve_symbol(*lib, "cos", cosine).ok());
  EXPECT_EQ(cosine(0.0), 1.0);
}

TEST(SharedLibrary, NamesEveryCandidateWhenNoneLoads) {
  const std::string other = "/nonexistent-dir/libtierzero-other.so.1";
  Expected<SharedLibrary> lib = SharedLibrary::open("NCCL", {kMissing, other});
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), ErrorCode::kNotFound);
  const std::string message = lib.status().message();
  EXPECT_NE(message.find("NCCL could not be loaded"), std::string::npos) << message;
  EXPECT_NE(message.find(kMissing), std::string::npos) << message;
  EXPECT_NE(message.find(other), std::string::npos) << message;
  EXPECT_NE(message.find("LD_LIBRARY_PATH"), std::string::npos) << message;

  Expected<SharedLibrary> none = SharedLibrary::open("cuBLAS", {});
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("cuBLAS"), std::string::npos) << none.status().message();
}

TEST(SharedLibrary, NamesTheMissingSymbolAndTheLibrary) {
  Expected<SharedLibrary> lib = SharedLibrary::open("libm", {kLibm});
  ASSERT_TRUE(lib.ok()) << lib.status().to_string();
  void (*missing)() = nullptr;
  const Status s = resolve_symbol(*lib, "tierzero_no_such_symbol", missing);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kNotFound);
  EXPECT_NE(s.message().find("tierzero_no_such_symbol"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(kLibm), std::string::npos) << s.message();
  EXPECT_EQ(missing, nullptr);

  SharedLibrary empty;
  EXPECT_FALSE(empty.symbol("cos").ok());
}

TEST(SharedLibrary, MovesOwnership) {
  Expected<SharedLibrary> lib = SharedLibrary::open("libm", {kLibm});
  ASSERT_TRUE(lib.ok());
  SharedLibrary moved = std::move(*lib);
  EXPECT_FALSE(lib->loaded());
  EXPECT_TRUE(moved.loaded());
  EXPECT_TRUE(moved.symbol("cos").ok());
  moved.reset();
  EXPECT_FALSE(moved.loaded());
}

// The first load() opens and resolves; later ones return its result without
// trying again, whether it succeeded or failed.
TEST(LazyLibrary, LoadsOnceAndKeepsTheFirstResult) {
  int resolves = 0;
  double (*cosine)(double) = nullptr;
  LazyLibrary good("libm", {kLibm}, [&](const SharedLibrary& lib) {
    ++resolves;
    return resolve_symbol(lib, "cos", cosine);
  });
  EXPECT_EQ(resolves, 0);  // nothing happens before the first use
  ASSERT_TRUE(good.load().ok()) << good.load().to_string();
  ASSERT_TRUE(good.load().ok());
  EXPECT_EQ(resolves, 1);
  EXPECT_EQ(good.path(), kLibm);
  EXPECT_EQ(cosine(0.0), 1.0);

  int tries = 0;
  LazyLibrary bad("NCCL", {kMissing}, [&](const SharedLibrary&) {
    ++tries;
    return ok_status();
  });
  const Status first = bad.load();
  ASSERT_FALSE(first.ok());
  EXPECT_NE(first.message().find(kMissing), std::string::npos) << first.message();
  EXPECT_EQ(bad.load().message(), first.message());
  EXPECT_EQ(tries, 0);  // never resolved: the library did not open
}

TEST(LazyLibrary, ReportsAMissingEntryPoint) {
  void (*missing)() = nullptr;
  LazyLibrary lib("libm", {kLibm},
                  [&](const SharedLibrary& l) { return resolve_symbol(l, "tierzero_no_such_symbol", missing); });
  const Status s = lib.load();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("tierzero_no_such_symbol"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace tz
