// Hugging Face names and layouts (see hf.h): the tensor table, config.json both ways, streaming
// export and checked, range-wise import.
#include "interop/hf.h"

#include <algorithm>
#include <exception>
#include <fstream>
#include <optional>
#include <set>
#include <stdexcept>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "config/shape.h"
#include "errors.h"
#include "model/gpt.h"

namespace sl::interop {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// ---- the table ----

// Adds the tensors of one unit. `rows` of a 2-D parameter are its dim 0; 1-D parameters have rows = elements.
struct LayoutBuilder {
  std::vector<HfTensor>& out;
  int64_t unit;
  void add(std::string name, std::vector<int64_t> shape, std::string param, int64_t rb, int64_t re, bool t = false) {
    out.push_back({std::move(name), std::move(shape), std::move(param), rb, re, t, unit});
  }
  // A whole parameter of `shape` (ours; the Hugging Face shape is its transpose when t).
  void whole(std::string name, std::vector<int64_t> shape, std::string param, bool t = false) {
    const int64_t rows = shape[0];
    if (t) std::swap(shape[0], shape[1]);
    add(std::move(name), std::move(shape), std::move(param), 0, rows, t);
  }
};

void gpt2_layout(const config::ModelConfig& m, std::vector<HfTensor>& out) {
  const int64_t C = m.n_embd, H = config::Shape(m).hidden(), V = m.vocab_size;
  const bool bias = m.bias;
  auto b = [&](const std::string& param) { return bias ? param : std::string(); };
  LayoutBuilder emb{out, model::kEmbeddingUnit};
  emb.whole("transformer.wte.weight", {V, C}, "wte");
  emb.whole("transformer.wpe.weight", {m.max_seq_len, C}, "wpe");
  for (int64_t l = 0; l < m.n_layer; ++l) {
    LayoutBuilder blk{out, model::block_unit(l)};
    const std::string h = fmt::format("transformer.h.{}.", l), p = fmt::format("blocks.{}.", l);
    blk.whole(h + "ln_1.weight", {C}, p + "ln1_w");
    blk.whole(h + "ln_1.bias", {C}, b(p + "ln1_b"));
    blk.whole(h + "attn.c_attn.weight", {3 * C, C}, p + "w_qkv", true);
    blk.whole(h + "attn.c_attn.bias", {3 * C}, b(p + "b_qkv"));
    blk.whole(h + "attn.c_proj.weight", {C, C}, p + "w_proj", true);
    blk.whole(h + "attn.c_proj.bias", {C}, b(p + "b_proj"));
    blk.whole(h + "ln_2.weight", {C}, p + "ln2_w");
    blk.whole(h + "ln_2.bias", {C}, b(p + "ln2_b"));
    blk.whole(h + "mlp.c_fc.weight", {H, C}, p + "w_fc", true);
    blk.whole(h + "mlp.c_fc.bias", {H}, b(p + "b_fc"));
    blk.whole(h + "mlp.c_proj.weight", {C, H}, p + "w_out", true);
    blk.whole(h + "mlp.c_proj.bias", {C}, b(p + "b_out"));
  }
  LayoutBuilder head{out, model::head_unit(m)};
  head.whole("transformer.ln_f.weight", {C}, "lnf_w");
  head.whole("transformer.ln_f.bias", {C}, b("lnf_b"));
  if (!m.tie_embeddings) head.whole("lm_head.weight", {V, C}, "lm_head");
}

void llama_layout(const config::ModelConfig& m, std::vector<HfTensor>& out) {
  const int64_t C = m.n_embd, H = config::Shape(m).hidden(), V = m.vocab_size;
  LayoutBuilder emb{out, model::kEmbeddingUnit};
  emb.whole("model.embed_tokens.weight", {V, C}, "wte");
  for (int64_t l = 0; l < m.n_layer; ++l) {
    LayoutBuilder blk{out, model::block_unit(l)};
    const std::string h = fmt::format("model.layers.{}.", l), p = fmt::format("blocks.{}.", l);
    blk.whole(h + "input_layernorm.weight", {C}, p + "ln1_w");
    blk.add(h + "self_attn.q_proj.weight", {C, C}, p + "w_qkv", 0, C);
    blk.add(h + "self_attn.k_proj.weight", {C, C}, p + "w_qkv", C, 2 * C);
    blk.add(h + "self_attn.v_proj.weight", {C, C}, p + "w_qkv", 2 * C, 3 * C);
    blk.whole(h + "self_attn.o_proj.weight", {C, C}, p + "w_proj");
    blk.whole(h + "post_attention_layernorm.weight", {C}, p + "ln2_w");
    blk.add(h + "mlp.gate_proj.weight", {H, C}, p + "w_fc", 0, H);
    blk.add(h + "mlp.up_proj.weight", {H, C}, p + "w_fc", H, 2 * H);
    blk.whole(h + "mlp.down_proj.weight", {C, H}, p + "w_out");
  }
  LayoutBuilder head{out, model::head_unit(m)};
  head.whole("model.norm.weight", {C}, "lnf_w");
  if (!m.tie_embeddings) head.whole("lm_head.weight", {V, C}, "lm_head");
}

const char* prefix(const config::ModelConfig& m) { return m.arch == config::Arch::kLlama ? "model." : "transformer."; }

// ---- config.json ----

// Hugging Face's model_type (config.json) of each architecture: the file format's names for them.
struct ModelType {
  config::Arch arch;
  std::string_view name;
};
constexpr ModelType kModelTypes[] = {{config::Arch::kGpt2, "gpt2"}, {config::Arch::kLlama, "llama"}};

std::string model_type(config::Arch arch) {
  for (const auto& t : kModelTypes)
    if (t.arch == arch) return std::string(t.name);
  throw std::logic_error("model_type: an architecture without a Hugging Face model_type");
}

// The architecture of a model_type; nullopt for one this trainer does not run.
std::optional<config::Arch> arch_of_model_type(std::string_view type) {
  for (const auto& t : kModelTypes)
    if (t.name == type) return t.arch;
  return std::nullopt;
}

Json gpt2_config(const config::ModelConfig& m) {
  // GPT-2's <|endoftext|>; a byte vocabulary has none (hf_config may override)
  const bool has_gpt2_ids = m.vocab_size > 50256;
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", model_type(config::Arch::kGpt2)},
          {"vocab_size", m.vocab_size},
          {"n_positions", m.max_seq_len},
          {"n_embd", m.n_embd},
          {"n_layer", m.n_layer},
          {"n_head", m.n_head},
          {"n_inner", config::Shape(m).hidden()},
          {"activation_function", "gelu_new"},  // the tanh approximation this project's GELU uses
          {"layer_norm_epsilon", m.norm_eps},
          {"resid_pdrop", m.dropout},
          {"embd_pdrop", m.dropout},
          {"attn_pdrop", m.dropout},
          {"initializer_range", m.init_std},
          {"scale_attn_weights", true},
          {"scale_attn_by_inverse_layer_idx", false},
          {"tie_word_embeddings", m.tie_embeddings},
          {"bos_token_id", has_gpt2_ids ? Json(50256) : Json(nullptr)},
          {"eos_token_id", has_gpt2_ids ? Json(50256) : Json(nullptr)}};
}

Json llama_config(const config::ModelConfig& m) {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", model_type(config::Arch::kLlama)},
          {"vocab_size", m.vocab_size},
          {"hidden_size", m.n_embd},
          {"intermediate_size", config::Shape(m).hidden()},
          {"num_hidden_layers", m.n_layer},
          {"num_attention_heads", m.n_head},
          {"num_key_value_heads", m.n_head},
          {"head_dim", m.n_embd / m.n_head},
          {"hidden_act", "silu"},
          {"max_position_embeddings", m.max_seq_len},
          {"rms_norm_eps", m.norm_eps},
          {"rope_theta", m.rope_theta},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", m.rope_theta}}},
          {"attention_bias", false},
          {"attention_dropout", m.dropout},
          {"mlp_bias", false},
          {"initializer_range", m.init_std},
          {"tie_word_embeddings", m.tie_embeddings},
          {"bos_token_id", nullptr},
          {"eos_token_id", nullptr}};
}

// One config.json comparison: the Hugging Face key, its value there, ours, and the recipe key to set.
struct ConfigCheck {
  const char* hf_key;
  Json ours;
  const char* recipe_key;
};

void compare(const Json& hf, const std::vector<ConfigCheck>& checks, std::vector<std::string>& diffs) {
  for (const auto& c : checks) {
    if (!hf.contains(c.hf_key)) continue;
    const Json& theirs = hf.at(c.hf_key);
    const bool same =
        theirs.is_number() && c.ours.is_number() ? theirs.get<double>() == c.ours.get<double>() : theirs == c.ours;
    if (!same)
      diffs.push_back(fmt::format("{} is {} but the recipe gives {}{}", c.hf_key, theirs.dump(), c.ours.dump(),
                                  c.recipe_key[0] ? fmt::format(" (set {}: {})", c.recipe_key, theirs.dump()) : ""));
  }
}

void check_gpt2_config(const Json& hf, const config::ModelConfig& m, std::vector<std::string>& diffs) {
  Json n_inner = hf.value("n_inner", Json(nullptr));
  const int64_t hidden = n_inner.is_null() ? 4 * hf.value("n_embd", m.n_embd) : n_inner.get<int64_t>();
  if (hidden != config::Shape(m).hidden())
    diffs.push_back(fmt::format("n_inner means an MLP of {} but the recipe gives {} (set model.mlp_hidden: {})", hidden,
                                config::Shape(m).hidden(), hidden));
  const std::string act = hf.value("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    diffs.push_back(fmt::format("activation_function is \"{}\"; this trainer's GELU is the tanh approximation "
                                "(\"gelu_new\"), so the model would compute something else", act));
  compare(hf,
          {{"n_layer", m.n_layer, "model.n_layer"},
           {"n_head", m.n_head, "model.n_head"},
           {"n_embd", m.n_embd, "model.n_embd"},
           {"vocab_size", m.vocab_size, "model.vocab_size"},
           {"n_positions", m.max_seq_len, "model.max_seq_len"},
           {"layer_norm_epsilon", m.norm_eps, "model.norm_eps"},
           {"tie_word_embeddings", m.tie_embeddings, "model.tie_embeddings"},
           {"scale_attn_weights", true, ""},
           {"scale_attn_by_inverse_layer_idx", false, ""}},
          diffs);
}

double rope_theta_of(const Json& hf, double fallback) {
  if (hf.contains("rope_parameters") && hf["rope_parameters"].is_object() &&
      hf["rope_parameters"].contains("rope_theta"))
    return hf["rope_parameters"]["rope_theta"].get<double>();
  return hf.value("rope_theta", fallback);
}

void check_llama_config(const Json& hf, const config::ModelConfig& m, std::vector<std::string>& diffs) {
  const double theta = rope_theta_of(hf, m.rope_theta);
  if (theta != m.rope_theta)
    diffs.push_back(
        fmt::format("rope_theta is {} but the recipe gives {} (set model.rope_theta: {})", theta, m.rope_theta, theta));
  const Json rp = hf.value("rope_parameters", Json(nullptr)), rs = hf.value("rope_scaling", Json(nullptr));
  const std::string rope_type = rp.is_object() ? rp.value("rope_type", "default") : "default";
  if (rope_type != "default" || !rs.is_null())
    diffs.push_back(fmt::format("RoPE scaling \"{}\" is not supported; only the default rotary embedding is",
                                rs.is_null() ? rope_type : rs.dump()));
  compare(hf,
          {{"num_hidden_layers", m.n_layer, "model.n_layer"},
           {"num_attention_heads", m.n_head, "model.n_head"},
           {"num_key_value_heads", m.n_head, ""},
           {"hidden_size", m.n_embd, "model.n_embd"},
           {"head_dim", m.n_embd / m.n_head, ""},
           {"intermediate_size", config::Shape(m).hidden(), "model.mlp_hidden"},
           {"vocab_size", m.vocab_size, "model.vocab_size"},
           {"rms_norm_eps", m.norm_eps, "model.norm_eps"},
           {"tie_word_embeddings", m.tie_embeddings, "model.tie_embeddings"},
           {"hidden_act", "silu", ""},
           {"attention_bias", false, ""},
           {"mlp_bias", false, ""}},
          diffs);
}

bool is_ignored_buffer(const std::string& name) {
  auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return ends_with(".attn.bias") || ends_with(".attn.masked_bias") || ends_with("rotary_emb.inv_freq");
}

std::string shape_text(const std::vector<int64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

}  // namespace

int64_t HfTensor::row_length() const {
  if (shape.size() == 1) return 1;
  return transposed ? shape[0] : shape[1];
}

std::vector<int64_t> HfTensor::param_shape() const {
  if (!transposed) return shape;
  return {shape[1], shape[0]};
}

std::vector<HfTensor> hf_layout(const config::ModelConfig& m) {
  if (!config::Shape(m).uniform())
    throw ConfigError(
        "model.layer_mlp_hidden: Hugging Face's GPT-2 and LLaMA classes give every block one MLP size, so "
        "this model (blocks of differing MLP sizes) has no Hugging Face layout; use its training states "
        "(state.*) instead");
  std::vector<HfTensor> out;
  if (m.arch == config::Arch::kLlama) llama_layout(m, out);
  else gpt2_layout(m, out);
  return out;
}

Json hf_config(const config::ModelConfig& m, at::ScalarType dtype, std::optional<int64_t> eos_id) {
  Json j = m.arch == config::Arch::kLlama ? llama_config(m) : gpt2_config(m);
  j["dtype"] = dtype == at::kBFloat16 ? "bfloat16" : "float32";
  if (eos_id) j["bos_token_id"] = j["eos_token_id"] = *eos_id;
  return j;
}

namespace {

config::ModelConfig gpt2_model(const Json& hf) {
  config::ModelConfig m;
  m.arch = config::Arch::kGpt2;
  m.n_layer = hf.value("n_layer", int64_t{12});
  m.n_head = hf.value("n_head", int64_t{12});
  m.n_embd = hf.value("n_embd", int64_t{768});
  m.vocab_size = hf.value("vocab_size", int64_t{50257});
  m.max_seq_len = hf.value("n_positions", int64_t{1024});
  const Json n_inner = hf.value("n_inner", Json(nullptr));
  m.mlp_hidden = n_inner.is_null() ? 4 * m.n_embd : n_inner.get<int64_t>();
  m.norm_eps = hf.value("layer_norm_epsilon", 1e-5);
  m.bias = true;  // GPT2LMHeadModel always has biases
  m.tie_embeddings = hf.value("tie_word_embeddings", true);
  m.dropout = 0.0;
  return m;
}

config::ModelConfig llama_model(const Json& hf) {
  config::ModelConfig m;
  m.arch = config::Arch::kLlama;
  m.n_layer = hf.value("num_hidden_layers", int64_t{32});
  m.n_head = hf.value("num_attention_heads", int64_t{32});
  m.n_embd = hf.value("hidden_size", int64_t{4096});
  m.vocab_size = hf.value("vocab_size", int64_t{32000});
  m.max_seq_len = hf.value("max_position_embeddings", int64_t{2048});
  m.mlp_hidden = hf.value("intermediate_size", int64_t{11008});
  m.norm_eps = hf.value("rms_norm_eps", 1e-6);
  m.rope_theta = rope_theta_of(hf, 10000.0);
  m.bias = false;
  m.tie_embeddings = hf.value("tie_word_embeddings", false);
  m.dropout = 0.0;
  return m;
}

}  // namespace


namespace {

// How config.json differs from the model `m` (empty: it describes m). `who` names the caller in the
// message of a key of the wrong type (DataError).
std::vector<std::string> config_differences(const Json& hf, const config::ModelConfig& m, const std::string& who,
                                            const std::string& where) {
  std::vector<std::string> diffs;
  try {
    const std::string type = hf.value("model_type", "");
    if (arch_of_model_type(type) != m.arch)
      diffs.push_back(fmt::format("model_type is \"{}\" but the recipe has model.arch: {}", type, m.arch.name()));
    else if (m.arch == config::Arch::kLlama) check_llama_config(hf, m, diffs);
    else check_gpt2_config(hf, m, diffs);
  } catch (const nlohmann::json::exception& e) {  // a key of the wrong type, e.g. "n_inner": "x"
    throw DataError(fmt::format("{}: {}: a key has the wrong type ({}); fix or remove the file", who, where, e.what()));
  }
  return diffs;
}

}  // namespace

void check_hf_config(const Json& hf, const config::ModelConfig& m, const std::string& where) {
  const auto diffs = config_differences(hf, m, "model.init_from", where);
  if (!diffs.empty())
    throw DataError(
        fmt::format("model.init_from: {} describes another model than the recipe: {}. Make the recipe match "
                    "the checkpoint (or remove config.json if it is stale)",
                    where, fmt::join(diffs, "; ")));
}

config::ModelConfig model_config_from_hf(const Json& hf, const std::string& where) {
  config::ModelConfig m;
  try {
    const std::string type = hf.value("model_type", "");
    const auto arch = arch_of_model_type(type);
    if (!arch)
      throw DataError(fmt::format("{}: model_type \"{}\" is not one this trainer runs (gpt2, llama)", where, type));
    m = *arch == config::Arch::kLlama ? llama_model(hf) : gpt2_model(hf);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: a key has the wrong type ({}); fix or remove the file", where, e.what()));
  }
  // What this project's model cannot express (grouped-query attention, RoPE scaling, another activation)
  // shows up as a difference from the model read above.
  const auto diffs = config_differences(hf, m, "sample --weights", where);
  if (!diffs.empty())
    throw DataError(fmt::format("{} describes a model this trainer cannot run: {}", where, fmt::join(diffs, "; ")));
  return m;
}

namespace {

// The directory and the streaming writer for write_hf; any filesystem failure becomes an IoError naming the path.
std::unique_ptr<state::SafetensorsWriter> open_hf_writer(const fs::path& file, const fs::path& dir,
                                                         const std::vector<HfTensor>& layout, at::ScalarType dtype,
                                                         const std::map<std::string, std::string>& metadata) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw IoError(fmt::format("cannot create {}: {}; choose a writable directory", dir.string(), ec.message()));
  std::vector<state::SafetensorsWriter::Spec> specs;
  for (const auto& t : layout) specs.push_back({t.name, dtype, t.shape});
  return std::make_unique<state::SafetensorsWriter>(file, std::move(specs), metadata);
}

// config.json next to the committed weights; if it cannot be written the weights go too, so a directory
// never holds a model.safetensors without the config.json that from_pretrained() needs.
void write_hf_config(const fs::path& file, const fs::path& dir, const config::ModelConfig& m, at::ScalarType dtype,
                     std::optional<int64_t> eos_id) {
  try {
    state::write_file_atomic(dir / "config.json", hf_config(m, dtype, eos_id).dump(2) + "\n");
    state::fsync_dir(dir);
  } catch (...) {
    std::error_code ec;
    fs::remove(file, ec);
    throw;
  }
}

}  // namespace

Written write_hf(const fs::path& file, const config::ModelConfig& m, at::ScalarType dtype, const WeightsSource& source,
                 bool write, const std::map<std::string, std::string>& metadata, std::optional<int64_t> eos_id) {
  const auto layout = hf_layout(m);
  const fs::path dir = file.has_parent_path() ? file.parent_path() : fs::path(".");
  Written out{file, {}, static_cast<int64_t>(layout.size())};
  // A failed write stops writing, not the walk: under zero3 the other ranks' gathers must still pair up.
  std::exception_ptr failed;
  std::unique_ptr<state::SafetensorsWriter> writer;
  if (write) {
    try {
      writer = open_hf_writer(out.file, dir, layout, dtype, metadata);
    } catch (...) {
      failed = std::current_exception();
    }
  }
  torch::NoGradGuard no_grad;
  size_t next = 0;
  for (int64_t unit = 0; unit < model::unit_count(m); ++unit) {
    source.enter(unit);
    for (; next < layout.size() && layout[next].unit == unit; ++next) {
      const HfTensor& t = layout[next];
      if (!writer) continue;
      try {
        const at::Tensor v = t.param.empty() ? torch::zeros(t.shape) : source.values(t).reshape(t.param_shape());
        writer->append((t.transposed ? v.t() : v).to(dtype));  // on its device: the writer stages it to host
      } catch (...) {
        failed = std::current_exception();
        writer.reset();  // removes the temporary
      }
    }
    source.leave(unit);
  }
  if (failed) std::rethrow_exception(failed);
  if (writer) {
    out.digest = writer->commit();
    write_hf_config(out.file, dir, m, dtype, eos_id);
  }
  return out;
}

void read_weights(model::GPTImpl& model, const WeightsSource& source) {
  torch::NoGradGuard no_grad;
  auto params = model.named_parameters();
  const auto layout = hf_layout(model.cfg);
  size_t next = 0;
  for (int64_t unit = 0; unit < model::unit_count(model.cfg); ++unit) {
    source.enter(unit);
    for (; next < layout.size() && layout[next].unit == unit; ++next) {
      const HfTensor& t = layout[next];
      if (t.param.empty()) continue;  // a zero bias the model does not have
      params[t.param].view({-1}).narrow(0, t.begin(), t.end() - t.begin()).copy_(source.values(t).reshape({-1}));
    }
    source.leave(unit);
  }
}

// ---- import ----

HfCheckpoint::HfCheckpoint(const fs::path& path, const config::ModelConfig& m) : model_(m), layout_(hf_layout(m)) {
  std::error_code ec;
  path_ = path;
  if (fs::is_directory(path, ec)) {
    path_ =
        fs::exists(path / "model.safetensors", ec) ? path / "model.safetensors" : path / "model.safetensors.index.json";
    if (!fs::exists(path_, ec))
      throw DataError(
          fmt::format("model.init_from: {} holds neither model.safetensors nor model.safetensors.index.json; "
                      "give the checkpoint file or the directory save_pretrained() wrote",
                      path.string()));
  }
  const fs::path config_path = path_.parent_path() / "config.json";
  if (fs::exists(config_path, ec)) {
    std::ifstream in(config_path);
    const Json hf = Json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (hf.is_discarded() || !hf.is_object())
      throw DataError(fmt::format("model.init_from: {} is not a JSON object; fix or remove it", config_path.string()));
    check_hf_config(hf, m, config_path.string());
  }
  try {
    open_files();
  } catch (const nlohmann::json::exception& e) {  // an index whose weight_map values are not file names
    throw DataError(fmt::format("model.init_from: {}: malformed index ({})", path_.string(), e.what()));
  }
  check_tensors();
  check_extras();
}

HfCheckpoint::~HfCheckpoint() = default;

void HfCheckpoint::open_files() {
  const bool index = path_.string().size() > 11 && path_.string().substr(path_.string().size() - 11) == ".index.json";
  std::vector<std::string> names;
  Json weight_map;
  if (index) {
    std::ifstream in(path_);
    const Json j = Json::parse(in, nullptr, false);
    if (j.is_discarded() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw DataError(
          fmt::format("model.init_from: {}: not a safetensors index (no \"weight_map\" object)", path_.string()));
    weight_map = j["weight_map"];
    for (const auto& [name, file] : weight_map.items())
      if (std::find(names.begin(), names.end(), file.get<std::string>()) == names.end())
        names.push_back(file.get<std::string>());
  }
  const std::string pre = prefix(model_);
  auto normalized = [&](const std::string& n) {
    return n.rfind(pre, 0) == 0 || n.rfind("lm_head.", 0) == 0 ? n : pre + n;  // base-model files lack the prefix
  };
  for (size_t i = 0; i < (index ? names.size() : 1); ++i) {
    const fs::path file = index ? path_.parent_path() / names[i] : path_;
    try {
      files_.push_back(std::make_unique<state::SafetensorsFile>(file));
    } catch (const Error& e) {
      throw DataError(fmt::format("model.init_from: {}", e.what()));
    }
    for (const auto& e : files_.back()->entries())
      if (!index || weight_map.value(e.name, "") == names[i]) where_[normalized(e.name)] = {i, e.name};
  }
  if (index)
    for (const auto& [name, file] : weight_map.items())
      if (!where_.count(normalized(name)))
        throw DataError(fmt::format("model.init_from: {} maps {} to {}, which does not hold it", path_.string(), name,
                                    file.get<std::string>()));
}

at::Tensor HfCheckpoint::view(const std::string& hf_name) const {
  const auto& [file, name] = where_.at(hf_name);
  return files_[file]->view(name);
}

void HfCheckpoint::check_tensors() {
  std::vector<std::string> problems;
  for (const auto& t : layout_) {
    const auto it = where_.find(t.name);
    if (it == where_.end()) {
      problems.push_back(fmt::format("tensor {} is missing", t.name));
      continue;
    }
    const auto* e = files_[it->second.first]->find(it->second.second);
    if (e->dtype != at::kFloat && e->dtype != at::kBFloat16 && e->dtype != at::kHalf)
      problems.push_back(
          fmt::format("tensor {} has dtype {} (expected F32, BF16 or F16)", t.name, c10::toString(e->dtype)));
    else if (e->shape != t.shape)
      problems.push_back(fmt::format("tensor {} has shape {} but the recipe's model needs {}", t.name,
                                     shape_text(e->shape), shape_text(t.shape)));
    else if (t.param.empty() && view(t.name).ne(0).any().item<bool>())
      problems.push_back(
          fmt::format("tensor {} is not zero but the recipe has model.bias: false (set it true)", t.name));
  }
  if (problems.empty() && model_.tie_embeddings && where_.count("lm_head.weight") &&
      !torch::equal(view("lm_head.weight"), view(layout_.front().name)))
    problems.push_back(
        "tensor lm_head.weight differs from the embeddings but the recipe has model.tie_embeddings: true "
        "(set it false)");
  if (!problems.empty())
    throw DataError(
        fmt::format("model.init_from: {} does not fit the recipe's model ({} {}, {} layers, d {}): {}. "
                    "Make the recipe describe the checkpoint's model",
                    path_.string(), model_.arch.name(),
                    model_.arch == config::Arch::kLlama ? "LlamaForCausalLM" : "GPT2LMHeadModel", model_.n_layer,
                    model_.n_embd, fmt::join(problems, "; ")));
}

void HfCheckpoint::check_extras() const {
  std::set<std::string> known;
  for (const auto& t : layout_) known.insert(t.name);
  if (model_.tie_embeddings) known.insert("lm_head.weight");
  std::vector<std::string> extra;
  for (const auto& [name, loc] : where_)
    if (!known.count(name) && !is_ignored_buffer(name)) extra.push_back(name);
  if (!extra.empty())
    throw DataError(fmt::format(
        "model.init_from: {} holds {} tensor(s) the recipe's model does not have: {}{}. Check "
        "model.arch, model.n_layer and model.bias against the checkpoint",
        path_.string(), extra.size(), fmt::join(extra.begin(), extra.begin() + std::min<size_t>(extra.size(), 5), ", "),
        extra.size() > 5 ? ", ..." : ""));
}

void HfCheckpoint::read(const std::string& param, int64_t begin, int64_t end, at::Tensor dst) const {
  int64_t K = 0;
  for (const auto& t : layout_)
    if (t.param == param) K = t.row_length();
  if (K == 0) throw std::logic_error("HfCheckpoint::read: no tensor holds parameter " + param);
  const int64_t r0 = begin / K, r1 = (end + K - 1) / K;
  // Rows no tensor holds are the vocabulary padding's (model.vocab_multiple: the checkpoint has
  // vocab_size rows of wte and lm_head, the model padded_vocab): zero, as the model initializes them.
  auto rows = torch::zeros({r1 - r0, K});
  for (const auto& t : layout_) {
    const int64_t a = std::max(r0, t.row_begin), b = std::min(r1, t.row_end);
    if (t.param != param || a >= b) continue;
    at::Tensor src = view(t.name);
    src = t.transposed ? src.t() : src.reshape({-1, K});
    rows.narrow(0, a - r0, b - a).copy_(src.narrow(0, a - t.row_begin, b - a));
  }
  dst.copy_(rows.view({-1}).narrow(0, begin - r0 * K, end - begin));
}

std::string HfCheckpoint::describe() const {
  std::set<std::string> dtypes;
  for (const auto& t : layout_) {
    const auto& [file, name] = where_.at(t.name);
    dtypes.insert(c10::toString(files_[file]->find(name)->dtype));
  }
  return fmt::format("{} ({} tensors in {} file(s), {})", path_.string(), layout_.size(), files_.size(),
                     fmt::join(dtypes, "/"));
}

WeightsSource HfCheckpoint::source(std::shared_ptr<HfCheckpoint> ckpt) {
  WeightsSource src;
  src.values = [ckpt](const HfTensor& t) {
    auto v = torch::empty({t.end() - t.begin()});
    ckpt->read(t.param, t.begin(), t.end(), v);
    return v;
  };
  return src;
}

}  // namespace sl::interop
