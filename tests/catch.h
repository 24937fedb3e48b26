// Catch2, either major version: Debian 12 ships 2.x (single header, catch2/catch.hpp), Ubuntu 24.04
// (3.4) and newer Debian (3.7) ship 3.x (a compiled library with per-topic headers). Tests include
// this file only and write the 2.x spellings; the 3.x branch supplies those that 3.x renamed.
#pragma once
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#define SUBLINEAR_CATCH_MAJOR 3
using Catch::Approx;  // 2.x: ::Approx; 3.x: Catch::Approx only
namespace Catch {
// 2.x's Catch::Contains (a string matcher) is Catch::Matchers::ContainsSubstring in 3.x.
inline Matchers::StringContainsMatcher Contains(const std::string& text,
                                                CaseSensitive sensitivity = CaseSensitive::Yes) {
  return Matchers::ContainsSubstring(text, sensitivity);
}
}  // namespace Catch
#else
#include <catch2/catch.hpp>
#define SUBLINEAR_CATCH_MAJOR 2
#endif

#include <cstdio>
#include <string>
#include <vector>

// Each test file's body sits in `namespace SUBLINEAR_TEST_FILE { ... }`. The test executable compiles
// its files in unity batches (CMakeLists.txt: several files, one translation unit), where CMake defines
// this name anew for each file (UNITY_BUILD_UNIQUE_ID), so that two files' helpers of the same name
// do not meet; a file compiled alone finds it undefined here and gets an anonymous namespace.
#ifndef SUBLINEAR_TEST_FILE
#define SUBLINEAR_TEST_FILE
#endif

// A case that cannot run here (no root for a tmpfs, no AVX-512) is reported as skipped, never as
// passed: SUBLINEAR_SKIP(why) ends the case (3.x: SKIP; 2.x has none: a warning, and the case ends
// without failing) and records `why`; a test process in which a case skipped and nothing failed
// exits kSkipExitCode (tests/main.cpp), which ctest shows as "Skipped" (Not Run) for an entry with
// SKIP_RETURN_CODE 77. Such a case carries a tag and runs as its own ctest entry, `<test>_<tag>`
// (CMakeLists.txt: SUBLINEAR_OWN_ENTRIES_<test>); the main entry leaves the tag out, and a skip in
// an entry without SKIP_RETURN_CODE fails it. Use in a TEST_CASE's body, not inside a lambda.
namespace sl::test {
inline constexpr int kSkipExitCode = 77;
// Why each case of this process that skipped did, in order.
inline std::vector<std::string>& skip_reasons() {
  static std::vector<std::string> reasons;
  return reasons;
}
// Failed assertions of the whole run, as Catch counted them (set by the listener in tests/main.cpp).
inline std::size_t& failed_assertions() {
  static std::size_t failed = 0;
  return failed;
}
// The process's exit status from Catch's: kSkipExitCode (the reasons on stdout) when a case skipped
// and no assertion failed (3.x returns 4 when every case skipped, 2.x 0); otherwise Catch's own.
inline int exit_status(int catch_status) {
  const bool catch_ok = catch_status == 0 || (SUBLINEAR_CATCH_MAJOR >= 3 && catch_status == 4);
  if (skip_reasons().empty() || !catch_ok || failed_assertions() > 0) return catch_status;
  for (const auto& why : skip_reasons()) std::printf("SKIPPED (exit %d): %s\n", kSkipExitCode, why.c_str());
  std::fflush(stdout);
  return kSkipExitCode;
}
}  // namespace sl::test

#if SUBLINEAR_CATCH_MAJOR >= 3
#define SUBLINEAR_SKIP(why)                                    \
  do {                                                         \
    const std::string sublinear_skip_why_ = (why);             \
    ::sl::test::skip_reasons().push_back(sublinear_skip_why_); \
    SKIP(sublinear_skip_why_);                                 \
  } while (false)
#else
#define SUBLINEAR_SKIP(why)                                    \
  do {                                                         \
    const std::string sublinear_skip_why_ = (why);             \
    ::sl::test::skip_reasons().push_back(sublinear_skip_why_); \
    WARN(sublinear_skip_why_);                                 \
    SUCCEED();                                                 \
    return;                                                    \
  } while (false)
#endif
