// Tracking CPU allocator and the memory tracker: a known allocation shows up exactly.
#include "catch.h"
#include <cstdlib>
#include <string>
#include <torch/torch.h>

#include "memory/cuda_limit.h"
#include "predict/footprint.h"
#include "memory/tracker.h"
#include "memory/tracking_allocator.h"
#include "test_util.h"

namespace SUBLINEAR_TEST_FILE {  // one per file (tests/catch.h)

using namespace sl;
using namespace sl::test;

TEST_CASE("a known allocation shows up exactly, and frees back to baseline") {
  memory::TrackingCPUAllocator::install();
  auto& alloc = memory::TrackingCPUAllocator::instance();
  const int64_t base = alloc.current_bytes();
  alloc.reset_peak();
  {
    auto t = torch::empty({1000, 37}, torch::kFloat32);  // 148,000 bytes
    CHECK(alloc.current_bytes() - base == 1000 * 37 * 4);
    auto u = torch::empty({5}, torch::kFloat64);  // 40 bytes
    CHECK(alloc.current_bytes() - base == 1000 * 37 * 4 + 40);
  }
  CHECK(alloc.current_bytes() == base);
  CHECK(alloc.peak_bytes() - base == 1000 * 37 * 4 + 40);
  alloc.reset_peak();
  CHECK(alloc.peak_bytes() == base);
}

TEST_CASE("the tracker reports the allocator's numbers on CPU") {
  memory::TrackingCPUAllocator::install();
  memory::Tracker tracker(torch::kCPU);
  CHECK(tracker.source() == "cpu_tracking_allocator");
  tracker.reset_peak();
  auto before = tracker.read();
  auto t = torch::ones({256, 256});  // 262,144 bytes
  auto after = tracker.read();
  CHECK(after.allocated_bytes - before.allocated_bytes == 256 * 256 * 4);
  CHECK(after.peak_allocated_bytes >= after.allocated_bytes);
  CHECK(after.reserved_bytes == after.allocated_bytes + memory::TrackingCPUAllocator::instance().cached_bytes());
}

TEST_CASE("temporaries count toward the peak but not the current bytes") {
  memory::TrackingCPUAllocator::install();
  memory::Tracker tracker(torch::kCPU);
  auto a = torch::ones({512, 512});
  tracker.reset_peak();
  const auto base = tracker.read();
  auto s = (a * 2 + 1).sum();  // two (512, 512) temporaries at most alive at once
  const auto after = tracker.read();
  CHECK(after.allocated_bytes - base.allocated_bytes == 4);  // the scalar
  CHECK(after.peak_allocated_bytes - base.allocated_bytes >= 512 * 512 * 4);
}

// The free-block cache (memory/tracking_allocator.h): a freed block is kept and handed to the next
// request of its exact size (the same address), counts in no pool's bytes (the counters and the peak
// are tensor bytes; the tracker's reserved bytes include it), and release_cached hands it back.
TEST_CASE("freed CPU blocks are reused by exact size, count as reserved but not allocated, and can be released") {
  memory::TrackingCPUAllocator::install();
  auto& alloc = memory::TrackingCPUAllocator::instance();
  memory::Tracker tracker(torch::kCPU);
  alloc.release_cached();
  if (const char* off = std::getenv("SUBLINEAR_NO_CPU_CACHE"); off && std::string(off) == "1") {
    { auto t = torch::empty({3, 1000}, torch::kFloat32); }  // this process runs without the cache
    CHECK(alloc.cached_bytes() == 0);
    return;
  }
  const int64_t base = alloc.current_bytes();
  constexpr int64_t kBytes = 3 * 1000 * 4;
  void* first = nullptr;
  {
    auto t = torch::empty({3, 1000}, torch::kFloat32);
    first = t.data_ptr();
  }
  CHECK(alloc.current_bytes() == base);
  CHECK(alloc.cached_bytes() == kBytes);
  const auto held = tracker.read();
  CHECK(held.reserved_bytes - held.allocated_bytes == kBytes);
  {
    auto other = torch::empty({7}, torch::kFloat32);  // another size: the kept block stays kept
    CHECK(alloc.cached_bytes() == kBytes);
    auto again = torch::empty({1000, 3}, torch::kFloat32);  // the same bytes
    CHECK(again.data_ptr() == first);
    CHECK(alloc.cached_bytes() == 0);
    CHECK(alloc.current_bytes() - base == kBytes + 7 * 4);
  }
  CHECK(alloc.cached_bytes() == kBytes + 7 * 4);
  alloc.release_cached();
  CHECK(alloc.cached_bytes() == 0);
  CHECK(alloc.current_bytes() == base);
}

// SUBLINEAR_NO_CPU_CACHE=1 turns the cache off (every free reaches malloc): a training step's reserved
// bytes are then its allocated bytes, while with the cache the step's freed activations are held.
TEST_CASE("SUBLINEAR_NO_CPU_CACHE=1: a trainer run's reserved bytes equal its allocated bytes; without it they exceed them") {
  for (const bool off : {false, true}) {
    CAPTURE(off);
    TempDir dir("nocache");
    const auto r = run("cd " + kSourceDir + " && OMP_NUM_THREADS=1 " + (off ? "SUBLINEAR_NO_CPU_CACHE=1 " : "env -u SUBLINEAR_NO_CPU_CACHE ") + kTrainer +
                       " --config configs/tiny.yaml --set train.steps=2 --set train.eval_interval=0 --set logging.dir=" +
                       dir.path.string() + " --set logging.save_model=false --set state.at_end=false");
    REQUIRE(r.code == 0);
    const auto steps = read_jsonl(dir.path / "metrics.jsonl");
    int seen = 0;
    for (const auto& rec : steps) {
      if (rec.contains("event") || !rec.contains("reserved_bytes")) continue;
      ++seen;
      const int64_t reserved = rec["reserved_bytes"].get<int64_t>(), allocated = rec["allocated_bytes"].get<int64_t>();
      if (off) CHECK(reserved == allocated);
      else CHECK(reserved > allocated);
      CHECK(rec.at("peak_reserved_bytes").is_null());  // a CUDA figure: the tracking allocator does not follow it
    }
    CHECK(seen == 2);
  }
}

// A training state holds the CPU generator's state (state/components.cpp); the planner counts it in an
// asynchronous save's host snapshot as memory::kCpuRngStateBytes, which must be what LibTorch makes.
TEST_CASE("the planner's size of the CPU RNG state is the tensor LibTorch's generator returns") {
  const auto state = at::globalContext().defaultGenerator(torch::kCPU).get_state();
  CHECK(static_cast<int64_t>(state.nbytes()) == memory::kCpuRngStateBytes);
}

// memory.limit on CUDA (memory/cuda_limit.h): AllocatedLimit admits an allocation against the exact
// allocated bytes, here those of a simulated caching allocator that hands out blocks of the request plus
// `extra` bytes (its rounding, or a cached block handed out whole), as CUDA's counts block sizes.
namespace {
struct FakeCachingAllocator {
  int64_t allocated = 0;  // the exact allocated bytes (the sum of live block sizes)
  int64_t extra = 0;      // what a block holds beyond its request
  int takes = 0, give_backs = 0, reads = 0;
  int64_t admit(memory::AllocatedLimit& limit, int64_t n) {
    return limit.admit(
        static_cast<size_t>(n), /*device=*/0,
        [&] {  // allocates: the handle is the block's size
          ++takes;
          allocated += n + extra;
          return n + extra;
        },
        [&](int64_t& block) {  // frees it
          ++give_backs;
          allocated -= block;
          block = 0;
        },
        [&] {
          ++reads;
          return allocated;
        });
  }
};
}  // namespace

TEST_CASE("memory.limit on CUDA: allocated bytes are admitted up to the limit, exactly, and a refusal allocates nothing") {
  memory::AllocatedLimit limit;
  FakeCachingAllocator dev;
  SECTION("no limit: no statistics read") {
    CHECK(dev.admit(limit, 1 << 20) == 1 << 20);
    CHECK(dev.reads == 0);
  }
  limit.set(1000);
  SECTION("far from the limit: one exact reading after each allocation; up to the limit exactly") {
    CHECK(dev.admit(limit, 400) == 400);
    CHECK(dev.admit(limit, 400) == 400);
    CHECK(dev.reads == 2);
    CHECK(dev.admit(limit, 200) == 200);  // 800 + 200 = 1000: the limit itself is allowed
    CHECK(dev.allocated == 1000);
  }
  SECTION("a request past the exact bytes is refused before anything is allocated") {
    dev.admit(limit, 800);
    CHECK_THROWS_AS(dev.admit(limit, 201), c10::OutOfMemoryError);
    CHECK(dev.takes == 1);
    CHECK(dev.allocated == 800);
    CHECK_THROWS_WITH(dev.admit(limit, 201), Catch::Contains("CUDA device 0 out of memory (memory.limit)") &&
                                                 Catch::Contains("allocating 201 bytes") &&
                                                 Catch::Contains("to at least 1001, past the 1000-byte memory.limit"));
  }
  SECTION("after frees the exact bytes decide, not the bytes at the last admission") {
    dev.admit(limit, 800);
    dev.allocated -= 500;  // tensors freed since: 300 live
    CHECK(dev.admit(limit, 600) == 600);
    CHECK(dev.allocated == 900);
  }
  SECTION("a block larger than its request that passes the limit is given back and refused") {
    dev.admit(limit, 600);
    dev.extra = 200;  // 600 + 300 fits, but the block of 500 does not
    CHECK_THROWS_AS(dev.admit(limit, 300), c10::OutOfMemoryError);
    CHECK(dev.takes == 2);
    CHECK(dev.give_backs == 1);
    CHECK(dev.allocated == 600);
    CHECK(dev.admit(limit, 200) == 400);  // 600 + 400 = 1000
  }
}

}  // namespace SUBLINEAR_TEST_FILE
