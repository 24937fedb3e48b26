// Host staging of tensors that leave the process (state files, final weights, export): the bound
// every writer keeps, in one place so the writer (state/safetensors.cpp, for_each_host_chunk) and the
// planner (predict/footprint.cpp, PeakPrediction::host_staging_bytes) agree. Torch-free.
#pragma once
#include <algorithm>
#include <cstdint>

namespace sl::device {

// A tensor on a non-CPU device is copied to host in pieces of at most this many bytes, one piece
// alive at a time.
inline constexpr int64_t kHostStagingBytes = int64_t{64} << 20;

// Host bytes a save adds on a non-CPU device: one staging buffer, no bigger than the largest tensor.
// CPU runs write every tensor from its own memory (0 added).
inline int64_t host_staging_bytes(int64_t largest_tensor_bytes) {
  return std::min(largest_tensor_bytes, kHostStagingBytes);
}

}  // namespace sl::device
