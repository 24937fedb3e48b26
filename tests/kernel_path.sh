#!/usr/bin/env bash
# kernel_path.sh COMMAND [ARGS...]: runs COMMAND (a test executable and its case filter) on this CPU's
# second kernel path, the libraries' kernels one level below what the CPU runs by default, so that a
# tolerance fitted to this machine's arithmetic fails here, where it was written, and not first on
# another CPU:
#   - a CPU with AVX-512 (Skylake-SP and later Xeons, Zen 4 EPYCs; with or without bf16 and AMX) takes
#     the path of an AVX2-only CPU: MKL's AVX2 branch (MKL_CBWR=AVX2), oneDNN capped at AVX2 (bf16 and
#     fp16 matmuls then take the widened path, as on such a CPU), ATen's AVX2 kernels;
#   - an AVX2-only CPU (the lowest this project targets) has no lower CPU to stand for, but MKL runs
#     its AVX branch there too: products without fused multiply-adds, rounded differently
#     (MKL_CBWR=AVX); ATen's and the project's own kernels stay on their AVX2 forms (the project's
#     16-lane AVX-512 forms give the same bits as their 8-lane ones, so those do not differ by CPU);
#   - any other CPU has no second path: the test reports itself skipped (exit 77).
# The variables reach every process the test starts (the trainer, its ranks, the Python references),
# so both sides of each comparison run on the capped path.
set -euo pipefail
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
if [[ "$flags" == *" avx512f "* ]]; then
  export MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
elif [[ "$flags" == *" avx2 "* && "$flags" == *" fma "* ]]; then
  export MKL_CBWR=AVX
else
  echo "SKIPPED (exit 77): this CPU has neither AVX-512 nor AVX2 with FMA: no second kernel path to run"
  exit 77
fi
echo "kernel path: MKL_CBWR=$MKL_CBWR ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-} ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-}"
exec "$@"
