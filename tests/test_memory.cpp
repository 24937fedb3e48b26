// Tracking CPU allocator and the memory tracker: a known allocation shows up exactly.
#include "catch.h"
#include <torch/torch.h>

#include "memory/tracker.h"
#include "memory/tracking_allocator.h"

using namespace sl;

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
  CHECK(after.reserved_bytes == after.allocated_bytes);
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
