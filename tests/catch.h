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

// Skips the rest of a test case that cannot run here (3.x: SKIP; 2.x has none: a warning, and the
// case passes without its assertions). Use in a TEST_CASE's body, not inside a lambda.
#if SUBLINEAR_CATCH_MAJOR >= 3
#define SUBLINEAR_SKIP(why) SKIP(why)
#else
#define SUBLINEAR_SKIP(why) \
  do {                      \
    WARN(why);              \
    SUCCEED();              \
    return;                 \
  } while (false)
#endif
