// What the CPU offers and what LibTorch's libraries make of it: the kernels a bf16/fp16 matmul takes
// on CPU decide how much memory autocast uses (predict/activations.h) and how fast it runs.
//
// Asked at run time, after any cap the user set, so the answer is what the libraries will do:
//   ATEN_CPU_CAPABILITY=avx2|avx512|default   caps ATen's vectorised kernels (at::get_cpu_capability)
//   ONEDNN_MAX_CPU_ISA=AVX2|AVX512_CORE|AVX512_CORE_VNNI|AVX512_CORE_BF16|...   caps oneDNN's
// (both are read when the libraries initialise: set them before the process starts). Capping
// oneDNN at AVX512_CORE_VNNI on a CPU with avx512_bf16 gives exactly the path of an AVX-512 Xeon
// without bf16 instructions (Cascade Lake); capping it at AVX2 the path of an AVX2-only CPU.
#pragma once
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "config/choices.h"

namespace sl::device {

// How a low-precision (bf16 / fp16) matmul runs on CPU under autocast.
enum class LowpMatmul {
  native,    // oneDNN brgemm with the CPU's bf16/fp16 instructions ("brg_matmul:avx512_core_bf16", AMX)
  emulated,  // oneDNN without them, on AVX-512 ("gemm:jit:bf16"): an fp32 accumulator per matmul output
  aten,      // no oneDNN kernel for the dtype (AVX2 only, or oneDNN capped below AVX512_CORE): ATen's gemm
  widened,   // the project's linears on the aten and emulated paths: fp32 GEMMs on widened operands
             // (model/linear.h); never a library's path, the one memory::lowp_matmul_path models
};
std::string to_string(LowpMatmul path);

struct CpuFeatures {
  std::string model_name;       // /proc/cpuinfo "model name" (else cpuinfo's name)
  std::string aten_capability;  // ATen's dispatch level: DEFAULT, AVX2, AVX512 (after ATEN_CPU_CAPABILITY)
  std::string onednn_max_isa;   // ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) as set; "" = not capped
  bool avx512 = false;          // the CPU's instructions (cpuinfo): AVX-512 F/BW/VL/DQ
  bool avx512_bf16 = false, amx_bf16 = false, avx_ne_convert = false, avx512_fp16 = false;
  bool onednn_bf16 = false;  // oneDNN takes bf16 matmuls (mkldnn::_is_mkldnn_bf16_supported, MKLDNN enabled)
  bool onednn_fp16 = false;  // oneDNN takes fp16 matmuls (needs native fp16 support)
  bool native_bf16 = false;  // oneDNN may use bf16 instructions: the CPU has them and the ISA cap allows them
  bool amx = false;          // ... AMX tiles among them
  // The fused bf16 attention may multiply with AVX512-BF16 (kernels/cpu/small_gemm.h): avx512_bf16 with
  // AVX-512 F/BW/VL/DQ, and oneDNN's cap allows avx512_core_bf16 (a lower cap stands for a CPU without).
  bool bf16_dot = false;
  // The fused GELU, softmax rows and fp32 attention products may run on 16 lanes
  // (device::avx512_kernels): AVX-512 F/BW/VL/DQ, and ATen's own kernels dispatch to AVX-512
  // (ATEN_CPU_CAPABILITY=avx2 caps this too).
  bool avx512_lanes = false;
  LowpMatmul bf16_matmul = LowpMatmul::aten;
  LowpMatmul fp16_matmul = LowpMatmul::aten;

  LowpMatmul matmul_path(config::Dtype compute) const;  // for precision.compute bf16 / fp16
  // What the model's linears take for them: matmul_path, or widened on the aten and emulated paths
  // while the fused kernels are on (model/linear.h; SUBLINEAR_ATEN_KERNELS=1 leaves them the libraries').
  LowpMatmul linear_path(config::Dtype compute) const;
  nlohmann::json to_json() const;  // for summary.json's "environment"
};

// This process's CPU, detected once.
const CpuFeatures& cpu_features();

// ---- which clone of the fused CPU kernels runs ----
// The project's fused CPU kernels (causal attention and its GEMM tiles, GELU, a bf16 run's LayerNorm and
// residual add, AdamW) are each built
// twice: an AVX2 + FMA clone (x86-64-v3) and a baseline x86-64 clone (GELU's, the softmax rows' and
// the fp32 GEMM tiles' vector clones also have a 16-lane AVX-512 form: avx512_kernels below). The
// vector clone runs where the
// CPU has AVX2 and FMA, unless the baseline is forced: SUBLINEAR_FORCE_BASELINE=1 in the environment
// (read once, at the first kernel call; unset, empty or 0: not forced; any other value forces it), or
// force_baseline_kernels(true) (the tests run both clones in one process). Attention and GELU results
// differ between the clones by float rounding (the vector clone fuses multiply-adds); AdamW's update is
// bitwise the same on both (src/optim/optimizer.cpp), so data-parallel replicas on different CPU kinds
// keep identical weights.

// The CPU runs AVX2 and FMA (x86-64-v3): the vector clones can run here.
bool cpu_has_avx2_fma();
// The vector clones run now: cpu_has_avx2_fma() and the baseline not forced. Cheap (a relaxed load).
bool vector_kernels();
// Forces the baseline clones (on) or lets the vector clones run where the CPU has them (off); returns
// the setting it replaces. Takes effect at the next kernel call: do not switch while a kernel runs.
bool force_baseline_kernels(bool on);
// The fused GELU, the attention's softmax rows and its fp32 products (kernels/cpu/small_gemm.h) run on 16
// lanes now (AVX-512, the same operations in the same order as their 8-lane AVX2 forms, so the same
// bits): vector_kernels(), CpuFeatures::avx512_lanes, and not turned off by force_avx2_kernels. The
// other fused kernels have no 16-lane form.
bool avx512_kernels();
// Keeps the vector clones on 8 lanes (on) or lets them take 16 where avx512_lanes says so (off);
// returns the setting it replaces. For tests (the two forms against each other).
bool force_avx2_kernels(bool on);
// "avx2_fma" or "baseline": the clone vector_kernels() picks now (summary.json's environment.cpu).
std::string kernel_clone_name();
// The GELU's lanes now: 16 (avx512_kernels), 8 (the AVX2 clone) or 1 (baseline); summary.json's
// environment.cpu.gelu_lanes.
int gelu_lanes();

// ---- the fused kernels or ATen's ----
// SUBLINEAR_ATEN_KERNELS=1 in the environment (read once, at the first ask; unset, empty or 0: the
// fused kernels; any other value: ATen's) makes the fused kernels' predicates (model::gelu_tanh_fused,
// gelu_tanh_bias_fused, causal_attention_fused, causal_attention_packed_fused, residual_add_fused,
// residual_bias_fused, layer_norm_bf16_fused) say false, and the widened linears (model/linear.h) with
// them (linear_path says aten), so a whole run takes at::gelu, at::scaled_dot_product_attention,
// at::layer_norm, x + y and at::linear with its bias, as a model without them would (to compare against;
// AdamW is not concerned). force_aten_kernels does the same in-process.

// The fused GELU and attention kernels and the widened linears may run: SUBLINEAR_ATEN_KERNELS's rule
// on its value, unless force_aten_kernels changed it since. Cheap (a relaxed load).
bool fused_kernels();
// The rule on a value of SUBLINEAR_ATEN_KERNELS (nullptr: unset): true for unset, empty or "0".
bool fused_kernels_from_env(const char* value);
// Turns the fused GELU and attention and the widened linears off (on = true) or back on; returns the
// setting it replaces (true: they were off). For tests; do not switch while a model runs.
bool force_aten_kernels(bool on);

// Whether oneDNN's ISA cap `cap` (an ONEDNN_MAX_CPU_ISA value, any case; "" = none) allows `isa`
// (a name of the same list). An unknown cap allows everything, as oneDNN ignores it.
bool onednn_isa_allows(const std::string& cap, const std::string& isa);

}  // namespace sl::device
