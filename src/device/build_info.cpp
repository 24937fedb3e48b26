// What this build is and what this machine offers of it (see build_info.h).
#include "device/build_info.h"

#include <algorithm>

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/version.h>
#if __has_include(<ATen/cuda/CUDAConfig.h>)
#include <ATen/cuda/CUDAConfig.h>
#endif

#include "device/cpu_features.h"
#include "sublinear_commit.h"  // generated at build time: SUBLINEAR_COMMIT, SUBLINEAR_BUILD_TYPE

namespace sl::device {
namespace {

using Json = nlohmann::json;

std::string compiler() {
#if defined(__clang__)
  return "clang " __clang_version__;
#elif defined(__GNUC__)
  return "GCC " __VERSION__;
#else
  return "unknown";
#endif
}

// The instruction-set macros the compiler defined for every file of the build (its -m / -march flags);
// the fused kernels' vector clones come on top of these (kernels()).
std::vector<std::string> compiled_isa() {
  std::vector<std::string> isa;
#if defined(__x86_64__)
  isa.emplace_back("x86-64");
#endif
#if defined(__aarch64__)
  isa.emplace_back("aarch64");
#endif
#if defined(__SSE2__)
  isa.emplace_back("sse2");
#endif
#if defined(__SSE4_2__)
  isa.emplace_back("sse4.2");
#endif
#if defined(__AVX__)
  isa.emplace_back("avx");
#endif
#if defined(__AVX2__)
  isa.emplace_back("avx2");
#endif
#if defined(__FMA__)
  isa.emplace_back("fma");
#endif
#if defined(__AVX512F__)
  isa.emplace_back("avx512f");
#endif
#if defined(__AVX512BF16__)
  isa.emplace_back("avx512bf16");
#endif
  return isa;
}

// The clones of the fused CPU kernels compiled in (device/cpu_features.h): on x86-64 every one, each
// picked at run time by what the CPU has; elsewhere the portable code alone.
std::vector<std::string> kernels() {
#if defined(__x86_64__)
  return {"baseline", "avx2_fma", "avx512", "avx512_bf16"};
#else
  return {"baseline"};
#endif
}

// LibTorch's CUDA runtime version ("13.0"), or null when it was built without CUDA.
Json cuda_version() {
  try {
    const long v = at::detail::getCUDAHooks().versionCUDART();
    return fmt::format("{}.{}", v / 1000, v % 1000 / 10);
  } catch (const c10::Error&) {
    return nullptr;
  }
}

Json cuda_info() {
#if __has_include(<ATen/cuda/CUDAConfig.h>)
  const std::vector<std::string> archs = cuda_archs_from_flags(NVCC_FLAGS_EXTRA);
#else
  const std::vector<std::string> archs;
#endif
  const Json version = cuda_version();
#if defined(SUBLINEAR_NCCL)
  const bool nccl = true;
#else
  const bool nccl = false;
#endif
#if defined(SUBLINEAR_CUDA_KERNELS)
  // src/kernels/cuda/*.cu built in (CMake: a CUDA compiler found, SUBLINEAR_CUDA_KERNELS on)
  const bool kernels = true;
#else
  const bool kernels = false;
#endif
  const bool available = torch::cuda::is_available();
  return {{"compiled", !version.is_null()}, {"version", version}, {"archs", archs}, {"nccl", nccl},
          {"kernels", kernels}, {"available", available},
          {"devices", available ? static_cast<int64_t>(torch::cuda::device_count()) : 0}};
}

std::string yes_no(const Json& b) { return b.get<bool>() ? "yes" : "no"; }

std::string joined(const Json& list, const char* sep) {
  std::string out;
  for (const auto& item : list) out += (out.empty() ? "" : sep) + item.get<std::string>();
  return out.empty() ? "none" : out;
}

}  // namespace

std::vector<std::string> cuda_archs_from_flags(const std::string& nvcc_flags) {
  std::vector<std::string> archs;
  for (size_t at = nvcc_flags.find("code="); at != std::string::npos; at = nvcc_flags.find("code=", at + 1)) {
    const size_t begin = at + 5;
    const size_t end = std::min(nvcc_flags.find_first_of("; ", begin), nvcc_flags.size());
    std::string list = nvcc_flags.substr(begin, end - begin);  // "sm_90" or "[sm_90,compute_90]"
    std::erase_if(list, [](char c) { return c == '[' || c == ']'; });
    for (size_t from = 0; from <= list.size();) {
      const size_t comma = std::min(list.find(',', from), list.size());
      const std::string arch = list.substr(from, comma - from);
      if (!arch.empty() && std::find(archs.begin(), archs.end(), arch) == archs.end()) archs.push_back(arch);
      from = comma + 1;
    }
  }
  return archs;
}

Json build_info() {
  Json this_cpu = cpu_features().to_json();
  this_cpu["avx2_fma"] = cpu_has_avx2_fma();
  return {{"version", SUBLINEAR_VERSION},
          {"commit", SUBLINEAR_COMMIT},
          {"build_type", SUBLINEAR_BUILD_TYPE},
          {"compiler", compiler()},
          {"libtorch", TORCH_VERSION},
          {"cuda", cuda_info()},
          {"cpu", {{"compiled_isa", compiled_isa()}, {"kernels", kernels()}, {"this_cpu", this_cpu}}}};
}

std::string version_text(const Json& info) {
  const auto& cuda = info["cuda"];
  const auto& cpu = info["cpu"];
  const auto& here = cpu["this_cpu"];
  std::string text = fmt::format("sublinear trainer {} (commit {}; {} build, {})\n", info["version"].get<std::string>(),
                                 info["commit"].get<std::string>(), info["build_type"].get<std::string>(),
                                 info["compiler"].get<std::string>());
  text += fmt::format("LibTorch {}\n", info["libtorch"].get<std::string>());
  if (cuda["compiled"].get<bool>())
    text += fmt::format("CUDA: compiled, runtime {}, architectures {}; NCCL backend {}; devices here {}\n",
                        cuda["version"].get<std::string>(), joined(cuda["archs"], " "), yes_no(cuda["nccl"]),
                        cuda["devices"].get<int64_t>());
  else
    text += "CUDA: not compiled in (a CPU-only LibTorch)\n";
  text += fmt::format("CUDA kernels: {}\n", yes_no(cuda["kernels"]));  // bench/gpu.sh requires yes on a GPU
  text += fmt::format("CPU code: compiled for {}; fused kernels built for {}\n", joined(cpu["compiled_isa"], " "),
                      joined(cpu["kernels"], ", "));
  text += fmt::format(
      "this CPU: {}; avx2_fma {}, avx512 {}, avx512_bf16 {}, amx_bf16 {}, avx512_fp16 {}; fused kernels "
      "run {}, ATen dispatches {}, bf16 linears take {}\n",
      here["cpu_model"].get<std::string>(), yes_no(here["avx2_fma"]), yes_no(here["avx512"]),
      yes_no(here["avx512_bf16"]), yes_no(here["amx_bf16"]), yes_no(here["avx512_fp16"]),
      here["fused_kernels"].get<std::string>(), here["aten_cpu_capability"].get<std::string>(),
      here["bf16_linear"].get<std::string>());
  text.pop_back();  // the last line's newline: the caller ends it
  return text;
}

}  // namespace sl::device
