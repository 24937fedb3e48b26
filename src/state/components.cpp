// The parts of a training state (see components.h): each one's entries, tensors and loading.
#include "state/components.h"

#include "device/host.h"

#include <cmath>
#include <map>

#include <ATen/Context.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

namespace sl::state {

std::string tensor_name(const std::string& field, const parallel::Span& sp, int64_t numel) {
  if (sp.begin == 0 && sp.end == numel) return field + "/" + sp.param;
  return fmt::format("{}/{}/{}:{}", field, sp.param, sp.begin, sp.end);
}

namespace {

using Json = nlohmann::json;

// ---- model states: parameters and AdamW moments, by element span ----


torch::optim::AdamWParamState* adam_state(torch::optim::AdamW& opt, const torch::Tensor& p) {
  auto it = opt.state().find(p.unsafeGetTensorImpl());
  return it == opt.state().end() ? nullptr : static_cast<torch::optim::AdamWParamState*>(it->second.get());
}

// The AdamW step count every parameter shares (0 before the first step).
int64_t adam_step(torch::optim::AdamW& opt) {
  for (auto& group : opt.param_groups())
    for (auto& p : group.params())
      if (auto* st = adam_state(opt, p)) return st->step();
  return 0;
}

void add_model_states(Parts& s, Named& out) {
  const auto shapes = param_shapes(s.cfg.model);
  const bool moments = adam_step(*s.opt) > 0;
  for (const auto& sp : s.strategy.owned_spans()) {
    const auto& shape = shapes.at(sp.param);
    const int64_t numel = c10::multiply_integers(shape);
    auto as_saved = [&](const torch::Tensor& flat) {
      return sp.begin == 0 && sp.end == numel ? flat.view(shape) : flat;
    };
    out.emplace_back(tensor_name("param", sp, numel), as_saved(sp.values));
    if (!moments) continue;
    const parallel::OptSlot slot = s.strategy.optimizer_slot(*s.opt, sp);
    auto* st = adam_state(*s.opt, slot.param);
    const int64_t len = sp.end - sp.begin;
    out.emplace_back(tensor_name("exp_avg", sp, numel), as_saved(st->exp_avg().view({-1}).narrow(0, slot.offset, len)));
    out.emplace_back(tensor_name("exp_avg_sq", sp, numel),
                     as_saved(st->exp_avg_sq().view({-1}).narrow(0, slot.offset, len)));
  }
}

void load_params(const Reader& r, Parts& s) {
  for (const auto& sp : s.strategy.held_spans()) r.read("param", sp, sp.values);
  s.strategy.params_loaded();
}

void load_moments(const Reader& r, Parts& s, int64_t step) {
  if (step == 0 || !r.has("exp_avg")) return;
  for (const auto& sp : s.strategy.owned_spans()) {
    const parallel::OptSlot slot = s.strategy.optimizer_slot(*s.opt, sp);
    auto* st = adam_state(*s.opt, slot.param);
    if (!st) {
      device::HostScope host(s.cfg.offload.optimizer);  // the moments live where the masters do
      auto fresh = std::make_unique<torch::optim::AdamWParamState>();
      fresh->step(step);
      fresh->exp_avg(torch::zeros_like(slot.param, at::MemoryFormat::Contiguous));
      fresh->exp_avg_sq(torch::zeros_like(slot.param, at::MemoryFormat::Contiguous));
      st = fresh.get();
      s.opt->state()[slot.param.unsafeGetTensorImpl()] = std::move(fresh);
    }
    const int64_t len = sp.end - sp.begin;
    r.read("exp_avg", sp, st->exp_avg().view({-1}).narrow(0, slot.offset, len));
    r.read("exp_avg_sq", sp, st->exp_avg_sq().view({-1}).narrow(0, slot.offset, len));
  }
}

class ModelStates final : public Component {
 public:
  explicit ModelStates(Parts& s) : s_(s) {}
  void add_meta(Json& meta) const override { meta["optimizer"] = {{"adamw_step", adam_step(*s_.opt)}}; }
  void add_tensors(Named& out) const override {
    if (s_.strategy.writes_model_states(s_.rank0())) add_model_states(s_, out);
  }
  void load(const Json& meta, const Reader& r) override {
    torch::NoGradGuard no_grad;
    load_params(r, s_);
    load_moments(r, s_, meta.at("optimizer").at("adamw_step").get<int64_t>());
  }

 private:
  Parts& s_;
};

// ---- RNG: the default generators of the CPU and (on CUDA) the run's GPU ----

class Rng final : public Component {
 public:
  explicit Rng(Parts& s) : s_(s) {}
  void add_meta(Json& /*meta*/) const override {}
  void add_tensors(Named& out) const override {
    out.emplace_back("rng/cpu", at::globalContext().defaultGenerator(torch::kCPU).get_state());
    if (s_.device.is_cuda()) out.emplace_back("rng/cuda", at::globalContext().defaultGenerator(s_.device).get_state());
  }
  void load(const Json& /*meta*/, const Reader& r) override {
    auto set = [&](c10::Device device, const std::string& which) {
      at::Generator gen = at::globalContext().defaultGenerator(device);  // shares the default generator
      if (auto saved = r.rng(s_.launch.rank, which); saved.defined()) gen.set_state(saved);
    };
    set(torch::kCPU, "cpu");
    if (s_.device.is_cuda()) set(s_.device, "cuda");
  }

 private:
  Parts& s_;
};

// ---- the loop's counters ----

class Loop final : public Component {
 public:
  explicit Loop(Counters& c) : c_(c) {}
  void add_meta(Json& meta) const override {
    meta["step"] = c_.steps_done;
    meta["loop"] = {{"skipped_steps", c_.skipped_steps},
                    {"consecutive_skips", c_.consecutive_skips},
                    {"last_val", std::isfinite(c_.last_val) ? Json(c_.last_val) : Json(nullptr)},
                    {"loss_average", std::isfinite(c_.loss_average) ? Json(c_.loss_average) : Json(nullptr)},
                    {"losses_seen", c_.losses_seen},
                    {"trained_tokens", c_.trained_tokens}};
  }
  void load(const Json& meta, const Reader& /*r*/) override {
    c_.steps_done = meta.at("step").get<int64_t>();
    const auto& loop = meta.at("loop");
    c_.skipped_steps = loop.at("skipped_steps").get<int64_t>();
    c_.consecutive_skips = loop.at("consecutive_skips").get<int64_t>();
    c_.last_val = loop.at("last_val").is_null() ? NAN : loop.at("last_val").get<double>();
    // States saved before train.on_spike existed have no average: it starts again from the resumed step.
    const Json average = loop.value("loss_average", Json(nullptr));
    c_.loss_average = average.is_null() ? NAN : average.get<double>();
    c_.losses_seen = loop.value("losses_seen", int64_t{0});
    c_.trained_tokens = loop.value("trained_tokens", int64_t{0});  // states from before examples: token windows
  }

 private:
  Counters& c_;
};

// ---- the data samplers' positions ----

class Samplers final : public Component {
 public:
  explicit Samplers(Parts& s) : s_(s) {}
  void add_meta(Json& meta) const override {
    meta["data"] = {{"train_sampler", s_.train_loader->position()}, {"val_sampler", s_.val_loader->position()}};
  }
  void load(const Json& meta, const Reader& /*r*/) override {
    s_.train_loader->restore(meta.at("data").at("train_sampler").get<uint64_t>());
    s_.val_loader->restore(meta.at("data").at("val_sampler").get<uint64_t>());
  }

 private:
  Parts& s_;
};

// ---- the dynamic loss scale (fp16) ----

class LossScale final : public Component {
 public:
  explicit LossScale(Parts& s) : s_(s) {}
  void add_meta(Json& meta) const override {
    Json scaler = nullptr;
    if (s_.scaler->enabled()) scaler = {{"scale", s_.scaler->scale()}, {"growth_tracker", s_.scaler->growth_tracker()}};
    meta["loss_scaler"] = scaler;
  }
  void load(const Json& meta, const Reader& /*r*/) override {
    const auto& sc = meta.at("loss_scaler");
    if (!sc.is_null() && s_.scaler->enabled())
      s_.scaler->restore(sc.at("scale").get<double>(), sc.at("growth_tracker").get<int64_t>());
  }

 private:
  Parts& s_;
};

}  // namespace

std::vector<std::unique_ptr<Component>> components(Parts& parts, Counters& counters) {
  std::vector<std::unique_ptr<Component>> out;
  out.push_back(std::make_unique<ModelStates>(parts));
  out.push_back(std::make_unique<Rng>(parts));
  out.push_back(std::make_unique<Loop>(counters));
  out.push_back(std::make_unique<Samplers>(parts));
  out.push_back(std::make_unique<LossScale>(parts));
  return out;
}

// Every parameter's shape, from a model on the meta device (ZeRO-3 frees the real ones between units).
std::map<std::string, std::vector<int64_t>> param_shapes(const config::ModelConfig& m) {
  torch::NoGradGuard no_grad;
  model::GPT meta(m, torch::kMeta);
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& item : meta->named_parameters()) out[item.key()] = item.value().sizes().vec();
  return out;
}

}  // namespace sl::state
