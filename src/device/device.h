// The run's device: which one train.device names, how a batch gets there, and what a device needs at
// the end of an optimizer step. Device-specific code of the step lives here (README "Devices").
//   cpu   the tested path; batches used as they are.
//   cuda  device `local_rank` (one GPU per local rank); batches staged through pinned memory and
//         copied without blocking (a pageable copy would wait for the stream: a host sync per batch).
//   lazy  a TEST device: LibTorch's lazy-tensor TorchScript backend (started once per process). Not
//         the CPU (is_cpu() false, data_ptr() null, tensors reach the host only by a copy), yet it runs
//         on the CPU, so the device-generic code is exercised here (tests/test_device.cpp). It records
//         ops into graphs; end_step() cuts them after every optimizer step, as a training loop on an
//         XLA-style device must, or each step would replay every earlier one.
#pragma once
#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "config/config.h"

namespace sl::device {

// Resolves train.device ("auto" = CUDA when available). Throws ConfigError when cuda is asked for and
// none is present, or when device `local_rank` is not among the visible ones (check_local_rank).
c10::Device resolve_device(const config::TrainConfig& t, int64_t local_rank = 0);

// A rank on CUDA uses device cuda:LOCAL_RANK. Throws ConfigError (exit 2) when that device is not
// among the `device_count` visible ones, naming LOCAL_RANK, CUDA_VISIBLE_DEVICES (`visible_devices`:
// its value, "" when unset) and what to do. `local_rank_set`: false when the launcher set no
// LOCAL_RANK and LaunchEnv took RANK for it (right on one node only), which the message then says.
void check_local_rank(int64_t local_rank, int64_t device_count, const std::string& visible_devices,
                      bool local_rank_set = true);

// A batch tensor (CPU, from the loader) on `device`.
at::Tensor to_device(const at::Tensor& t, c10::Device device);

// precision.tf32 (config::Tf32::enabled): fp32 matmuls (cuBLAS) and cuDNN convolutions on TF32 tensor
// cores (on = true) or in IEEE fp32 (false), process-wide; a CUDA run's set-up calls it once.
void set_tf32(bool on);
// Whether fp32 matmuls on CUDA take TF32 now (what set_tf32 set, or LibTorch's default: off).
bool tf32_matmuls();

// After an optimizer step: lazy runs the step's recorded graph and starts a new one; others nothing.
void end_step(c10::Device device);

}  // namespace sl::device
