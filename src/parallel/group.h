// One flat parameter group of the data-parallel engine (parallel/engine.h): its members' layout and the
// buffers each stage and the host placement bind to it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "device/host.h"
#include "parallel/comm.h"

namespace sl::parallel {

struct Group {
  std::string name;
  std::vector<torch::Tensor> params;  // matrices first, then vectors
  std::vector<std::string> names;     // the parameters' names in the model
  std::vector<int64_t> offsets;
  int64_t numel = 0, decay = 0, padded = 0, shard = 0;
  int64_t rank = 0;
  torch::Tensor flat_param;   // zero*: the whole group in the compute dtype (zero3: storage only while gathered)
  torch::Tensor shard_param;  // the optimizer's fp32 master: zero*, this rank's slice (zero3, a low-precision
                              // compute copy or offload.optimizer: its own buffer; otherwise a view of
                              // flat_param); DDP with offload.optimizer, the whole group on the host
  torch::Tensor master_full;  // a low-precision compute copy: the group's fp32 masters, gathered for reading
  torch::Tensor flat_grad;    // none/zero1: persistent, .grad are views; zero2/3: transient
  torch::Tensor shard_grad;   // zero*: this rank's slice of the summed gradient (offload.gradients: on the host)
  torch::Tensor host_grad;    // offload.optimizer with the gradient on the device: the host AdamW's copy of it
  torch::Tensor rs_out;       // zero2/3: reduce-scatter result while in flight
  torch::Tensor accum;        // what zero_grad zeroes and the last micro-batch averages (flat_grad or shard_grad)
  torch::Tensor step_grad;    // the gradient the optimizer reads (none: flat_grad; zero*: shard_grad)
  size_t ready = 0;
  bool gathered = true;
  Pending pending;    // the gradient collective in flight
  Pending gathering;  // zero3: the parameter all-gather in flight (a prefetch until waited)
  device::Arrival arrived;  // zero3: the side stream's copy in and all-gather issue (device/host.h)
  int64_t bytes() const { return padded * 4; }  // the group in fp32
  torch::Tensor slot() const { return flat_param.narrow(0, shard * rank, shard); }  // this rank's part of flat_param
};

}  // namespace sl::parallel
