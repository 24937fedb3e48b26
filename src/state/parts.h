// What a training state is made of and how a saved one is read back, apart from the saving and
// finding (state.h): the parts a run lends (Parts, Counters) and the reader of a found state's rank
// files (Reader). The components (components.h) need these and nothing else of state.h.
#pragma once
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <c10/core/Device.h>
#include <torch/optim/adamw.h>

#include "config/config.h"
#include "data/loader.h"
#include "parallel/comm.h"
#include "parallel/strategy.h"
#include "precision/loss_scaler.h"
#include "state/safetensors.h"

namespace sl::state {

// What a training state is made of, as a run holds it: the only things save() and load() read or
// write. The run (train/) lends them for the loop (saves) or the restore (load); an asynchronous save
// keeps none of them past its own calls.
//   strategy         the parameters: the element spans this rank's optimizer updates
//                    (strategy.owned_spans(): whole parameters, or a ZeRO shard), re-sharded on load
//   opt              AdamW's moments of those spans and its step count
//   scaler           the dynamic loss scale and its growth tracker (fp16)
//   loaders          the train and validation samplers' positions
//   device           which RNG states to save (CPU always, CUDA on a GPU)
struct Parts {
  const config::RunConfig& cfg;
  parallel::LaunchEnv launch;
  parallel::Comm* comm = nullptr;
  c10::Device device{c10::kCPU};
  parallel::Strategy& strategy;
  torch::optim::AdamW* opt = nullptr;
  precision::LossScaler* scaler = nullptr;
  data::Loader* train_loader = nullptr;
  data::Loader* val_loader = nullptr;
  std::string run_dir;  // state.dir's default root is <run_dir>/state
  int64_t world() const { return launch.world; }
  bool rank0() const { return launch.rank == 0; }
};

// The loop's counters a state carries (the training loop's LoopState extends it).
struct Counters {
  int64_t steps_done = 0, skipped_steps = 0, consecutive_skips = 0;
  double last_val = NAN;  // the newest validation loss (NaN: none yet)
  double loss_average = NAN;  // train.on_spike's moving average of step losses (NaN: none yet; train/spike.h)
  int64_t losses_seen = 0;    // the finite losses it has taken
  int64_t trained_tokens = 0;  // examples (data.source): trained targets over the steps done; 0 for token windows
};

// The rank files of a found state, mapped, with an index of their pieces by (field, param): reads any
// element range of a parameter (or its moments) whatever world size and sharding wrote it.
class Reader {
 public:
  Reader(const std::filesystem::path& dir, const nlohmann::json& meta);
  ~Reader();
  bool has(const std::string& field) const;  // "exp_avg": the state holds AdamW moments
  // Elements of `field` of `param` the saved run had (a whole tensor's, or the end of its last piece);
  // -1 when the state holds none.
  int64_t saved_elements(const std::string& field, const std::string& param) const;
  // Copies elements [sp.begin, sp.end) of `field` (param | exp_avg | exp_avg_sq) of sp.param into
  // `dst` (1-D, sp.end - sp.begin); StateFileError when the files do not cover the range.
  void read(const std::string& field, const parallel::Span& sp, torch::Tensor dst) const;
  // This rank's RNG state ("cpu" | "cuda"): its own file's when the state has one for its rank, else rank 0's.
  torch::Tensor rng(int64_t rank, const std::string& which) const;

 private:
  struct Entry {
    size_t file;
    std::string name;
    int64_t begin, end;
  };
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::pair<std::string, std::string>, std::vector<Entry>> index_;
};

}  // namespace sl::state
