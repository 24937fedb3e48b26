// CPU features and the low-precision matmul path the libraries take (see cpu_features.h).
#include "device/cpu_features.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <unordered_map>
#include <utility>

#include <ATen/Context.h>
#include <ATen/Version.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/Utils.h>
#include <nlohmann/json.hpp>

namespace sl::device {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// oneDNN's ISA values as feature masks (its cpu_isa_t): a cap allows an ISA whose features it holds.
// 0 = not a known name.
unsigned isa_mask(const std::string& name) {
  enum : unsigned { sse41 = 1, avx = 2, avx2 = 4, avx_vnni = 8, avx2_vnni_2 = 16, a512 = 32, a512_vnni = 64,
                    a512_bf16 = 128, avx10_1 = 256, amx = 512, amx_fp16 = 1024, avx10_2 = 2048, amx_2 = 4096 };
  const unsigned m_avx2 = sse41 | avx | avx2, m_avx2_vnni = m_avx2 | avx_vnni,
                 m_avx2_vnni_2 = m_avx2_vnni | avx2_vnni_2;
  const unsigned m_bf16 = m_avx2 | a512 | a512_vnni | a512_bf16, m_avx10_1 = m_bf16 | m_avx2_vnni_2 | avx10_1;
  const unsigned m_amx = m_avx10_1 | amx, m_amx_fp16 = m_amx | amx_fp16, m_avx10_2 = m_avx10_1 | avx10_2;
  static const std::array<std::pair<const char*, unsigned>, 19> masks{{
      {"sse41", sse41}, {"avx", sse41 | avx}, {"avx2", m_avx2}, {"avx2_vnni", m_avx2_vnni},
      {"avx2_vnni_2", m_avx2_vnni_2}, {"avx512_core", m_avx2 | a512}, {"avx512_core_vnni", m_avx2 | a512 | a512_vnni},
      {"avx512_core_bf16", m_bf16}, {"avx512_core_fp16", m_avx10_1}, {"avx10_1_512", m_avx10_1},
      {"avx512_core_amx", m_amx}, {"avx10_1_512_amx", m_amx}, {"avx512_core_amx_fp16", m_amx_fp16},
      {"avx10_1_512_amx_fp16", m_amx_fp16}, {"avx10_2_512", m_avx10_2},
      {"avx10_2_512_amx_2", m_avx10_2 | m_amx_fp16 | amx_2}, {"all", ~0u}, {"default", ~0u}, {"", ~0u}}};
  const auto n = lower(name);
  for (const auto& [k, m] : masks)
    if (n == k) return m;
  return 0;
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

std::string proc_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    auto pos = line.find(':');
    if (pos == std::string::npos) continue;
    auto v = line.substr(pos + 1);
    v.erase(0, v.find_first_not_of(" \t"));
    return v;
  }
  return "";
}

// A registered no-argument boolean operator (mkldnn::_is_mkldnn_bf16_supported and the like):
// false when this LibTorch has no such operator.
bool ask_operator(const char* name) {
  auto op = c10::Dispatcher::singleton().findSchema({name, ""});
  return op.has_value() && op->typed<bool()>().call();
}

bool flag(const std::unordered_map<std::string, c10::IValue>& caps, const char* key) {
  auto it = caps.find(key);
  return it != caps.end() && it->second.isBool() && it->second.toBool();
}

CpuFeatures detect() {
  CpuFeatures f;
  const auto caps = at::cpu::get_cpu_capabilities();
  f.model_name = proc_model_name();
  if (f.model_name.empty() && caps.count("cpu_name") && caps.at("cpu_name").isString())
    f.model_name = caps.at("cpu_name").toStringRef();
  f.aten_capability = at::get_cpu_capability();
  f.onednn_max_isa = env("ONEDNN_MAX_CPU_ISA");
  if (f.onednn_max_isa.empty()) f.onednn_max_isa = env("DNNL_MAX_CPU_ISA");
  f.avx512 = flag(caps, "avx512_f") && flag(caps, "avx512_bw") && flag(caps, "avx512_vl") && flag(caps, "avx512_dq");
  f.avx512_bf16 = flag(caps, "avx512_bf16");
  f.amx_bf16 = flag(caps, "amx_bf16") && flag(caps, "amx_tile");
  f.avx_ne_convert = flag(caps, "avx_ne_convert");
  f.avx512_fp16 = flag(caps, "avx512_fp16");
  const bool mkldnn = at::globalContext().userEnabledMkldnn();
  f.onednn_bf16 = mkldnn && ask_operator("mkldnn::_is_mkldnn_bf16_supported");
  f.onednn_fp16 = mkldnn && ask_operator("mkldnn::_is_mkldnn_fp16_supported");
  const auto& cap = f.onednn_max_isa;
  f.amx = f.amx_bf16 && onednn_isa_allows(cap, "avx512_core_amx");
  f.native_bf16 = (f.avx512_bf16 && onednn_isa_allows(cap, "avx512_core_bf16")) || f.amx ||
                  (f.avx_ne_convert && onednn_isa_allows(cap, "avx2_vnni_2"));
  f.bf16_dot = f.avx512 && f.avx512_bf16 && onednn_isa_allows(cap, "avx512_core_bf16");
  f.avx512_lanes = f.avx512 && f.aten_capability == "AVX512";
  f.bf16_matmul = !f.onednn_bf16 ? LowpMatmul::aten : f.native_bf16 ? LowpMatmul::native : LowpMatmul::emulated;
  // oneDNN takes fp16 only with native fp16 support (avx512_fp16, avx_ne_convert).
  f.fp16_matmul = f.onednn_fp16 ? LowpMatmul::native : LowpMatmul::aten;
  return f;
}

}  // namespace

std::string to_string(LowpMatmul path) {
  switch (path) {
    case LowpMatmul::native: return "onednn_native";
    case LowpMatmul::emulated: return "onednn_emulated";
    case LowpMatmul::widened: return "widened";
    case LowpMatmul::aten: break;
  }
  return "aten";
}

bool onednn_isa_allows(const std::string& cap, const std::string& isa) {
  const unsigned c = isa_mask(cap), i = isa_mask(isa);
  return c == 0 || (i & c) == i;
}

LowpMatmul CpuFeatures::matmul_path(config::Dtype compute) const {
  if (compute == config::Dtype::kBf16) return bf16_matmul;
  if (compute == config::Dtype::kFp16) return fp16_matmul;
  return LowpMatmul::aten;
}

LowpMatmul CpuFeatures::linear_path(config::Dtype compute) const {
  const LowpMatmul path = matmul_path(compute);
  const bool slow = path == LowpMatmul::aten || path == LowpMatmul::emulated;
  return slow && compute != config::Dtype::kFp32 && fused_kernels() ? LowpMatmul::widened : path;
}

nlohmann::json CpuFeatures::to_json() const {
  return {{"cpu_model", model_name},
          {"aten_cpu_capability", aten_capability},
          {"onednn_max_cpu_isa", onednn_max_isa.empty() ? nlohmann::json(nullptr) : nlohmann::json(onednn_max_isa)},
          {"avx512", avx512},
          {"avx512_bf16", avx512_bf16},
          {"amx_bf16", amx_bf16},
          {"avx_ne_convert", avx_ne_convert},
          {"avx512_fp16", avx512_fp16},
          {"onednn_bf16", onednn_bf16},
          {"onednn_fp16", onednn_fp16},
          {"native_bf16", native_bf16},
          {"amx", amx},
          {"bf16_dot", bf16_dot},
          {"avx512_lanes", avx512_lanes},
          {"bf16_matmul", to_string(bf16_matmul)},
          {"fp16_matmul", to_string(fp16_matmul)},
          // the model's linears: widened where bf16_matmul is aten or emulated
          {"bf16_linear", to_string(linear_path(config::Dtype::kBf16))},
          {"fp16_linear", to_string(linear_path(config::Dtype::kFp16))},
          {"fused_kernels", kernel_clone_name()},
          {"gelu_lanes", gelu_lanes()},  // 16 where the GELU's vector clone runs on AVX-512
          {"aten_kernels", !fused_kernels()}};  // SUBLINEAR_ATEN_KERNELS: GELU, attention and linears left to ATen
}

namespace {

// Set from SUBLINEAR_FORCE_BASELINE when first asked; force_baseline_kernels changes it.
std::atomic<bool>& baseline_forced() {
  static std::atomic<bool> forced{[] {
    const std::string v = env("SUBLINEAR_FORCE_BASELINE");
    return !v.empty() && v != "0";
  }()};
  return forced;
}

// Set by force_avx2_kernels (tests).
std::atomic<bool>& avx2_forced() {
  static std::atomic<bool> forced{false};
  return forced;
}

// Set from SUBLINEAR_ATEN_KERNELS when first asked; force_aten_kernels changes it.
std::atomic<bool>& aten_forced() {
  static std::atomic<bool> forced{!fused_kernels_from_env(std::getenv("SUBLINEAR_ATEN_KERNELS"))};
  return forced;
}

}  // namespace

bool fused_kernels_from_env(const char* value) {
  const std::string v = value ? value : "";
  return v.empty() || v == "0";
}

bool fused_kernels() { return !aten_forced().load(std::memory_order_relaxed); }

bool force_aten_kernels(bool on) { return aten_forced().exchange(on, std::memory_order_relaxed); }

bool cpu_has_avx2_fma() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

bool vector_kernels() { return cpu_has_avx2_fma() && !baseline_forced().load(std::memory_order_relaxed); }

bool force_baseline_kernels(bool on) { return baseline_forced().exchange(on, std::memory_order_relaxed); }

bool avx512_kernels() {
  static const bool lanes = cpu_features().avx512_lanes;
  return lanes && vector_kernels() && !avx2_forced().load(std::memory_order_relaxed);
}

bool force_avx2_kernels(bool on) { return avx2_forced().exchange(on, std::memory_order_relaxed); }

std::string kernel_clone_name() { return vector_kernels() ? "avx2_fma" : "baseline"; }

int gelu_lanes() {
  if (avx512_kernels()) return 16;
  return vector_kernels() ? 8 : 1;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

}  // namespace sl::device
