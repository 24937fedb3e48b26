// Catch2 entry point shared by every test executable (Catch2 2.x or 3.x, see catch.h). A process in
// which a case skipped (SUBLINEAR_SKIP) and nothing failed exits 77, which ctest reports as skipped.
#if !__has_include(<catch2/catch_all.hpp>)
#define CATCH_CONFIG_RUNNER
#endif
#include "catch.h"

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

}  // namespace

CATCH_REGISTER_LISTENER(FailureCounter)

int main(int argc, char** argv) { return sl::test::exit_status(Catch::Session().run(argc, argv)); }
