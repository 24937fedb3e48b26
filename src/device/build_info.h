// What this build is: the version, the commit it came from, the LibTorch it was compiled against, the
// CUDA and CPU code compiled into it, and what this machine offers of them at run time. Printed by
// `trainer --version`; summary.json's "build".
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace sl::device {

// The architectures in an nvcc flag list ("-gencode;arch=compute_90,code=sm_90;..." or
// "-gencode arch=compute_90,code=[sm_90,compute_90]"), in order, each once: {"sm_90", "compute_90"}.
std::vector<std::string> cuda_archs_from_flags(const std::string& nvcc_flags);

// {"version", "commit", "build_type", "compiler", "libtorch",
//  "cuda": {"compiled", "version", "archs", "nccl", "kernels", "available", "devices"},
//  "cpu": {"compiled_isa", "kernels", "this_cpu": {"avx2_fma", ...CpuFeatures::to_json()}}}
nlohmann::json build_info();

// build_info() as the lines `trainer --version` prints (no newline after the last).
std::string version_text(const nlohmann::json& info);

}  // namespace sl::device
