// The parts of a training state, each saving and loading its own piece: its entries in meta.json,
// its tensors in this rank's file, and what loading (and re-sharding) means for it. state/state.cpp
// walks the list; it knows the directory layout, the files and their checks, not what is in them.
//
//   part          meta.json                     rank file                        on load
//   model states  optimizer.adamw_step          param/, exp_avg/, exp_avg_sq/     the element spans this rank
//                                               <param>[/<begin>:<end>]           holds, from whichever files
//                                               (sharded: every rank; else rank 0) have them (re-sharding)
//   RNG           -                             rng/cpu, rng/cuda (on CUDA)       this rank's, else rank 0's
//   loop          step, loop.{skipped_steps,    -                                 the counters
//                 consecutive_skips, last_val}
//   samplers      data.{train,val}_sampler      -                                 the loaders' positions
//   loss scaler   loss_scaler.{scale,           -                                 the scale (fp16; null when
//                 growth_tracker}                                                  the scaler is off)
#pragma once
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "state/parts.h"

namespace sl::state {

using Named = std::vector<std::pair<std::string, torch::Tensor>>;

class Component {
 public:
  virtual ~Component() = default;
  virtual void add_meta(nlohmann::json& meta) const = 0;  // rank 0: its entries of meta.json
  virtual void add_tensors(Named& /*out*/) const {}         // every rank: its tensors in the rank's file
  // Reads its piece back from a found state (meta = the whole meta.json).
  virtual void load(const nlohmann::json& meta, const Reader& reader) = 0;
};

// The parts of a run, in the order they are written and loaded (the model states first: their
// tensors lead the rank file, and the RNG is restored after the parameters are in place).
std::vector<std::unique_ptr<Component>> components(Parts& parts, Counters& counters);

// Every parameter's shape, from a model on the meta device (ZeRO-3 frees the real ones between units).
std::map<std::string, std::vector<int64_t>> param_shapes(const config::ModelConfig& m);

// "<field>/<param>" for a whole parameter, "<field>/<param>/<begin>:<end>" for elements [begin, end)
// of the flattened parameter (Reader parses them back).
std::string tensor_name(const std::string& field, const parallel::Span& sp, int64_t numel);

}  // namespace sl::state
