// Catch2 entry point of the test executable (Catch2 2.x or 3.x, see catch.h). A process in which a case
// skipped (SUBLINEAR_SKIP) and nothing failed exits 77, which ctest reports as skipped.
//
// One executable, `sublinear_tests`, holds every tests/test_<name>.cpp (compiled in unity batches:
// CMakeLists.txt); the build links `test_<name>` to it for each file. Run under such a name, it runs
// that file's cases only: the file's tag `[#test_<name>]` (Catch's filenames-as-tags) joins every
// alternative of the test spec, so `build/test_device "[cuda]"` is test_device's [cuda] cases, as when
// each file was an executable of its own. Under its own name it runs every file.
#if !__has_include(<catch2/catch_all.hpp>)
#define CATCH_CONFIG_RUNNER
#endif
#include <string>
#include <vector>

#include "catch.h"
#include "zygote.h"

namespace {

#if SUBLINEAR_CATCH_MAJOR >= 3
using ListenerBase = Catch::EventListenerBase;
#else
using ListenerBase = Catch::TestEventListenerBase;
#endif

// Keeps the run's failed-assertion count for sl::test::exit_status (Catch's exit status alone
// cannot tell 3.x's "every case skipped" (4) from four failures).
struct FailureCounter : ListenerBase {
  using ListenerBase::ListenerBase;
  void testRunEnded(const Catch::TestRunStats& stats) override {
    sl::test::failed_assertions() = stats.totals.assertions.failed;
    ListenerBase::testRunEnded(stats);
  }
};

// "test_<name>" when the executable was started as a test_<name> link, else "" (every file).
std::string file_of(const char* argv0) {
  std::string base = argv0;
  const auto slash = base.find_last_of('/');
  if (slash != std::string::npos) base.erase(0, slash + 1);
  return base.rfind("test_", 0) == 0 ? base : "";
}

// The alternatives of one test-spec argument: split at commas outside quotes and not escaped.
std::vector<std::string> alternatives(const std::string& spec) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (size_t i = 0; i < spec.size(); ++i) {
    const char c = spec[i];
    if (c == '\\' && i + 1 < spec.size()) {
      out.back() += spec.substr(i++, 2);
      continue;
    }
    if (c == '"') quoted = !quoted;
    if (c == ',' && !quoted) {
      out.emplace_back();
      continue;
    }
    out.back() += c;
  }
  return out;
}

// Whether an alternative has a pattern that is not an exclusion (~[tag], ~name, exclude:...).
bool has_required_pattern(const std::string& alt) {
  bool negated = false;
  for (size_t i = 0; i < alt.size(); ++i) {
    const char c = alt[i];
    if (c == ' ') continue;
    if (c == '~') {
      negated = true;
      continue;
    }
    if (alt.compare(i, 8, "exclude:") == 0) {
      negated = true;
      i += 7;
      continue;
    }
    if (!negated) return true;
    // Skip the excluded pattern: a [tag], a "quoted name" or a bare name up to the next pattern.
    const char close = c == '[' ? ']' : c == '"' ? '"' : '\0';
    if (close != '\0') {
      const auto end = alt.find(close, i + 1);
      i = end == std::string::npos ? alt.size() : end;
    } else {
      while (i + 1 < alt.size() && alt[i + 1] != '[' && alt[i + 1] != '~') ++i;
    }
    negated = false;
  }
  return false;
}

// The spec that runs `specs` among the cases of `file` only. Hidden cases ([.name]): with no spec they
// stay out, hence "~[.]" then. Catch2 2.x runs them for any spec with a filter, so a filter's meaning
// is kept by adding the file's tag alone; 3.x runs them only for an alternative with a required
// pattern, which the file's tag is, so a 3.x alternative of exclusions only also gets "~[.]".
std::vector<std::string> only_file(const std::string& file, const std::vector<std::string>& specs) {
  const std::string tag = "[#" + file + "]";
  if (specs.empty()) return {tag + "~[.]"};
  std::vector<std::string> out;
  for (const auto& spec : specs) {
    std::string joined;
    for (const auto& alt : alternatives(spec)) {
      if (!joined.empty()) joined += ',';
      joined += tag + alt;
      if (SUBLINEAR_CATCH_MAJOR >= 3 && !has_required_pattern(alt)) joined += "~[.]";
    }
    out.push_back(joined);
  }
  return out;
}

}  // namespace

CATCH_REGISTER_LISTENER(FailureCounter)

int main(int argc, char** argv) {
  // Before anything runs: the copy of this process that trainer runs are forked from (tests/zygote.h).
  sl::test::zygote::start(SUBLINEAR_TRAINER);
  Catch::Session session;
  if (const int bad = session.applyCommandLine(argc, argv); bad != 0) return bad;
  if (const auto file = file_of(argv[0]); !file.empty()) {
    auto& data = session.configData();
    data.filenamesAsTags = true;
    data.testsOrTags = only_file(file, data.testsOrTags);
  }
  return sl::test::exit_status(session.run());
}
