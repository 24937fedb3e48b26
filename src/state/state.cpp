// Saving and loading the training state (layout and rules: state.h).
#include "state/state.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <cstring>

#include <ATen/Context.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <torch/version.h>

#include "errors.h"
#include "device/host.h"
#include "log/clock.h"
#include "state/components.h"
#include "state/safetensors.h"

namespace sl::state {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using log::Clock;

const char* const kFields[] = {"param", "exp_avg", "exp_avg_sq"};

std::string step_dir_name(int64_t step) { return fmt::format("step-{:08d}", step); }
std::string rank_file_name(int64_t rank) { return fmt::format("rank-{:05d}.safetensors", rank); }

// "step-00000050" -> 50; -1 for anything else.
int64_t step_of(const std::string& name) {
  if (name.size() != 13 || name.rfind("step-", 0) != 0) return -1;
  int64_t v = -1;
  const auto r = std::from_chars(name.data() + 5, name.data() + name.size(), v);
  return r.ec == std::errc() && r.ptr == name.data() + name.size() ? v : -1;
}

// ---- meta.json's own checksum ----

constexpr const char* kMetaChecksum = "meta_crc32";

// CRC-32 of the compact dump of everything in meta.json but the checksum itself (JSON objects dump
// with sorted keys and round-trip numbers exactly, so a parsed copy dumps to the same bytes).
uint32_t meta_crc(Json meta) {
  meta.erase(kMetaChecksum);
  const std::string text = meta.dump();
  return crc32(text.data(), text.size());
}

Json with_checksum(Json meta) {
  meta[kMetaChecksum] = meta_crc(meta);
  return meta;
}

// "" when meta.json's checksum holds; format 1 states (written before it existed) have none.
std::string check_meta_crc(const Json& meta, const fs::path& path) {
  if (meta.at("format_version").get<int>() < 2) return "";
  if (!meta.contains(kMetaChecksum) || !meta.at(kMetaChecksum).is_number_unsigned())
    return fmt::format("{} has no {} (corrupt)", path.string(), kMetaChecksum);
  if (meta.at(kMetaChecksum).get<uint32_t>() != meta_crc(meta))
    return fmt::format("{} fails its CRC-32 check ({}: a value in it was changed; corrupt)", path.string(),
                       kMetaChecksum);
  return "";
}

// ---- tensor names: "<field>/<param>" or "<field>/<param>/<begin>:<end>" ----

struct Piece {
  std::string field, param;
  int64_t begin = 0, end = -1;  // end -1: the whole parameter
};

std::optional<Piece> parse_name(const std::string& name) {
  const auto slash = name.find('/');
  if (slash == std::string::npos) return std::nullopt;
  Piece p{name.substr(0, slash), name.substr(slash + 1)};
  const auto last = p.param.rfind('/');
  if (last == std::string::npos) return p;
  const std::string range = p.param.substr(last + 1);
  const auto colon = range.find(':');
  if (colon == std::string::npos) return std::nullopt;
  auto num = [](const std::string& t, int64_t& v) {
    return std::from_chars(t.data(), t.data() + t.size(), v).ec == std::errc();
  };
  if (!num(range.substr(0, colon), p.begin) || !num(range.substr(colon + 1), p.end) || p.end < p.begin)
    return std::nullopt;
  p.param.resize(last);
  return p;
}

// ---- saving ----

std::string project_version() { return SUBLINEAR_VERSION; }

// train.global_batch, or (0) what the mesh trains per step.
int64_t global_batch(const config::TrainConfig& t, const layout::Mesh& mesh) {
  return t.global_batch > 0 ? t.global_batch : mesh.global_batch(t.micro_batch, t.grad_accum);
}

// The math keys' values, as the resolved recipe JSON holds them (train.global_batch resolved).
// A math value as compared on resume: data.source `bin` is the old name of `llmc`.
Json canonical(const std::string& key, const Json& v) {
  if (key != "data.source" || !v.is_string()) return v;
  const auto source = config::DataSource::parse(v.get<std::string>());
  return source && source->llmc() ? Json(config::DataSource(config::DataSource::kLlmc)) : v;
}

Json math_values(const Json& recipe, int64_t global) {
  Json out = Json::object();
  for (const auto& key : math_keys()) {
    const auto dot = key.find('.');
    const auto& sec = recipe.at(key.substr(0, dot));
    out[key] = key == "train.global_batch" ? Json(global) : sec.value(key.substr(dot + 1), Json(nullptr));
  }
  return out;
}

// meta.json's content but its file list: the state's identity (format, versions, world size, sharding,
// recipe and its math) and each part's entries (components.h), as they stand now.
Json meta_content(Parts& s, const Counters& st) {
  const Json recipe = config::to_json(s.cfg);
  const Json math = math_values(recipe, global_batch(s.cfg.train, s.cfg.mesh()));
  Json meta = {{"format", "sublinear-training-state"},
               {"format_version", kFormatVersion},
               {"sublinear_version", project_version()},
               {"torch_version", TORCH_VERSION},
               {"world_size", s.world()},
               {"sharding", s.cfg.parallel.sharding},
               {"recipe", recipe},
               {"math", math},
               {"math_hash", fmt::format("{:08x}", crc32(math.dump().data(), math.dump().size()))}};
  Counters counters = st;
  for (const auto& part : components(s, counters)) part->add_meta(meta);
  return meta;
}

// meta.json: its content with every rank file's size and CRC-32 ([ok, bytes, crc32] per rank).
Json with_files(Json meta, int64_t world, const std::vector<double>& digests) {
  Json files = Json::array();
  for (int64_t r = 0; r < world; ++r)
    files.push_back({{"name", rank_file_name(r)},
                     {"bytes", static_cast<int64_t>(digests[static_cast<size_t>(3 * r + 1)])},
                     {"crc32", static_cast<uint32_t>(digests[static_cast<size_t>(3 * r + 2)])}});
  meta["files"] = std::move(files);
  return meta;
}

// This rank's file: each part's tensors.
Named rank_tensors(Parts& s, const Counters& st) {
  Named out;
  Counters counters = st;
  for (const auto& part : components(s, counters)) part->add_tensors(out);
  return out;
}

// Runs `fn` on rank 0 and makes its failure every rank's, with rank 0's exit code and message (an exception
// that is not an Error is an IoError); the others would otherwise wait in the next collective.
template <class F>
void on_rank0_together(Parts& s, const std::string& what, F&& fn) {
  int code = kExitOk;
  std::string error;
  if (s.rank0()) {
    try {
      fn();
    } catch (const Error& e) {
      code = e.code, error = e.what();
    } catch (const std::exception& e) {
      code = kExitIo, error = e.what();
    }
  }
  s.comm->fail_together(code, error, what);
}

void make_fresh_dir(const fs::path& root, const fs::path& tmp) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) throw IoError(fmt::format("state.dir: cannot create {} ({})", root.string(), ec.message()));
  recover_replaced(root);
  for (const auto& e : fs::directory_iterator(root)) {  // earlier saves cut short by a crash
    const std::string n = e.path().filename().string();
    if (n.rfind(".step-", 0) == 0 && n.size() > 4 && n.compare(n.size() - 4, 4, ".tmp") == 0)
      fs::remove_all(e.path(), ec);
  }
  fs::create_directory(tmp, ec);
  if (ec) throw IoError(fmt::format("state.dir: cannot create {} ({})", tmp.string(), ec.message()));
}

// This rank's file in `tmp`, as [ok, bytes, crc32]; `error` says why when not ok.
std::vector<double> write_rank_file(const fs::path& tmp, int64_t rank, const Named& tensors, std::string& error) {
  try {
    const FileDigest d = write_safetensors(tmp / rank_file_name(rank), tensors);
    return {1.0, static_cast<double>(d.bytes), static_cast<double>(d.crc32)};
  } catch (const std::exception& e) {
    error = e.what();
    return {0.0, 0.0, 0.0};
  }
}

// Every rank's [ok, bytes, crc32] (a collective); when any rank failed, rank 0 removes `tmp` and every
// rank throws IoError (its own error, or one naming the rank that failed).
std::vector<double> agree_on_files(Parts& s, const std::vector<double>& mine, const std::string& error,
                                   const fs::path& tmp) {
  const auto all = s.world() > 1 ? s.comm->all_gather(mine, "state save") : mine;
  for (int64_t r = 0; r < s.world(); ++r)
    if (all[static_cast<size_t>(3 * r)] == 0.0) {
      std::error_code ec;
      if (s.rank0()) fs::remove_all(tmp, ec);
      throw IoError(error.empty() ? fmt::format("rank {} could not write its part of the state (see its error)", r)
                                  : error);
    }
  return all;
}

void prune(const fs::path& root, int64_t keep, const std::string& newest) {
  if (keep <= 0) return;
  std::vector<std::pair<int64_t, fs::path>> states;
  for (const auto& e : fs::directory_iterator(root))
    if (const int64_t step = step_of(e.path().filename().string()); step >= 0) states.emplace_back(step, e.path());
  std::sort(states.rbegin(), states.rend());
  for (size_t i = static_cast<size_t>(keep); i < states.size(); ++i)
    if (states[i].second.filename() != newest) {
      spdlog::info("state.keep {}: removing the older state {}", keep, states[i].second.string());
      fs::remove_all(states[i].second);
    }
}

// Rank 0, after every rank file is on disk: meta.json, then the rename, then `latest`, then (with
// `prune_now`) state.keep; on failure `tmp` is removed (the previous state stays newest).
void publish(Parts& s, const Json& content, int64_t step, const fs::path& root, const fs::path& tmp,
             const std::vector<double>& digests, bool prune_now = true) {
  const std::string name = step_dir_name(step);
  try {
    write_file_atomic(tmp / "meta.json", with_checksum(with_files(content, s.world(), digests)).dump(2) + "\n");
    fsync_dir(tmp);
    install_state_dir(tmp, root / name);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  write_file_atomic(root / "latest", name + "\n");
  fsync_dir(root);
  if (prune_now) prune(root, s.cfg.state.keep, name);
}

// ---- finding and checking ----

std::string check_files(const fs::path& dir, const Json& meta) {
  for (const auto& f : meta.at("files")) {
    const fs::path p = dir / f.at("name").get<std::string>();
    std::error_code ec;
    const auto size = fs::file_size(p, ec);
    if (ec) return fmt::format("{} is missing", p.string());
    if (static_cast<int64_t>(size) != f.at("bytes").get<int64_t>())
      return fmt::format("{} has {} bytes, meta.json says {} (truncated?)", p.string(), size,
                         f.at("bytes").get<int64_t>());
    if (crc32_file(p) != f.at("crc32").get<uint32_t>())
      return fmt::format("{} fails its CRC-32 check (corrupt)", p.string());
  }
  return "";
}

// Reads and checks a state directory; returns the reason it is unusable ("" = valid).
std::string check_state(const fs::path& dir, Json& meta) {
  const fs::path mp = dir / "meta.json";
  std::error_code ec;
  if (!fs::exists(mp, ec)) return fmt::format("{} is missing", mp.string());
  try {
    std::ifstream in(mp);
    meta = Json::parse(in);
    if (meta.value("format", "") != "sublinear-training-state")
      return fmt::format("{} is not a sublinear state", mp.string());
    const int version = meta.at("format_version").get<int>();
    if (version < 1 || version > kFormatVersion)
      return fmt::format("{} has format_version {}, this build reads 1 to {}", mp.string(),
                         meta.at("format_version").dump(), kFormatVersion);
    if (std::string why = check_meta_crc(meta, mp); !why.empty()) return why;
    return check_files(dir, meta);
  } catch (const std::exception& e) {
    return fmt::format("{} cannot be read ({})", mp.string(), e.what());
  }
}

std::string read_latest(const fs::path& root) {
  std::ifstream in(root / "latest");
  std::string name;
  std::getline(in, name);
  return name;
}

// Candidates under a state root, newest first; `latest` first when it names one.
std::vector<fs::path> candidates(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> states;
  std::error_code ec;
  if (fs::is_directory(root, ec))
    for (const auto& e : fs::directory_iterator(root))
      if (const int64_t step = step_of(e.path().filename().string()); step >= 0) states.emplace_back(step, e.path());
  std::sort(states.rbegin(), states.rend());
  std::vector<fs::path> out;
  const std::string latest = read_latest(root);
  if (step_of(latest) >= 0 && fs::is_directory(root / latest, ec)) out.push_back(root / latest);
  for (const auto& [step, p] : states)
    if (out.empty() || p != out.front()) out.push_back(p);
  return out;
}

// The newest valid state under root; none there at all: not found. States that are all unusable are
// refused rather than silently starting over.
Found find_auto(const fs::path& root) {
  recover_replaced(root);
  const auto dirs = candidates(root);
  for (const auto& dir : dirs) {
    Found f{dir, -1, nullptr};
    const std::string why = check_state(dir, f.meta);
    if (why.empty()) {
      f.step = f.meta.at("step").get<int64_t>();
      return f;
    }
    spdlog::warn("--resume auto: skipping state {}: {}", dir.string(), why);
  }
  if (!dirs.empty())
    throw StateFileError(fmt::format("--resume auto: none of the {} states under {} is usable (see the warnings); "
                                     "resume from a copy with --resume PATH, or start a new run",
                                     dirs.size(), root.string()));
  return {};
}

// PATH: a step directory, a state root, or a run directory with state/.
Found find_path(const fs::path& path) {
  std::error_code ec;
  fs::path dir = path;
  if (!fs::exists(path / "meta.json", ec)) {
    const fs::path root = fs::exists(path / "latest", ec) ? path : path / "state";
    const std::string latest = read_latest(root);
    if (step_of(latest) < 0)
      throw StateFileError(fmt::format("--resume {}: no saved state there (expected a step-NNNNNNNN directory with "
                                       "meta.json, or a directory whose `latest` names one)", path.string()));
    dir = root / latest;
  }
  Found f{dir, -1, nullptr};
  if (const std::string why = check_state(dir, f.meta); !why.empty())
    throw StateFileError(fmt::format("--resume {}: the state is unusable: {}. Resume from an older state directory, "
                                     "or use --resume auto to take the newest valid one", path.string(), why));
  f.step = f.meta.at("step").get<int64_t>();
  return f;
}

// Where rank 0's choice lies, as the other ranks work it out from the same arguments.
fs::path chosen_dir(const std::string& resume, const fs::path& root, int64_t step) {
  const fs::path base = resume == config::kResumeNewest ? root : fs::path(resume);
  std::error_code ec;
  if (fs::exists(base / "meta.json", ec)) return base;
  return (resume == config::kResumeNewest || fs::exists(base / "latest", ec) ? base : base / "state") /
         step_dir_name(step);
}

// ---- loading ----

}  // namespace

Reader::Reader(const fs::path& dir, const Json& meta) {
  for (const auto& f : meta.at("files"))
    files_.push_back(std::make_unique<SafetensorsFile>(dir / f.at("name").get<std::string>()));
  for (size_t i = 0; i < files_.size(); ++i)
    for (const auto& e : files_[i]->entries())
      if (auto p = parse_name(e.name)) index_[{p->field, p->param}].push_back({i, e.name, p->begin, p->end});
}

Reader::~Reader() = default;

bool Reader::has(const std::string& field) const {
  return std::any_of(index_.begin(), index_.end(), [&](const auto& kv) { return kv.first.first == field; });
}

int64_t Reader::saved_elements(const std::string& field, const std::string& param) const {
  const auto it = index_.find({field, param});
  if (it == index_.end()) return -1;
  int64_t n = 0;
  for (const auto& e : it->second)
    n = std::max(n, e.end < 0 ? c10::multiply_integers(files_[e.file]->find(e.name)->shape) : e.end);
  return n;
}

void Reader::read(const std::string& field, const parallel::Span& sp, torch::Tensor dst) const {
  std::vector<std::pair<int64_t, int64_t>> pieces;  // [a, b) of sp copied, to check they tile it exactly
  const auto it = index_.find({field, sp.param});
  if (it != index_.end())
    for (const auto& e : it->second) {
      const torch::Tensor src = files_[e.file]->view(e.name).reshape({-1});
      const int64_t begin = e.begin, end = e.end < 0 ? begin + src.numel() : e.end;
      const int64_t a = std::max(begin, sp.begin), b = std::min(end, sp.end);
      if (a >= b) continue;
      dst.narrow(0, a - sp.begin, b - a).copy_(src.narrow(0, a - begin, b - a));
      pieces.emplace_back(a, b);
    }
  std::sort(pieces.begin(), pieces.end());
  int64_t covered = sp.begin;
  for (const auto& [a, b] : pieces) {
    if (a < covered)
      throw StateFileError(
          fmt::format("state: the files hold elements [{}, {}) of {} of {} more than once (overlapping "
                      "pieces; the state is corrupt or mixes two saves)",
                      a, std::min(b, covered), field, sp.param));
    if (a > covered) break;
    covered = b;
  }
  if (covered != sp.end)
    throw StateFileError(fmt::format("state: {} of {} elements [{}, {}) are not in the state's files", field, sp.param,
                                     std::max(covered, sp.begin), sp.end));
}

torch::Tensor Reader::rng(int64_t rank, const std::string& which) const {
  for (const size_t i : {static_cast<size_t>(rank), size_t{0}})
    if (i < files_.size() && files_[i]->find("rng/" + which)) return files_[i]->view("rng/" + which).clone();
  return {};
}

void install_state_dir(const fs::path& tmp, const fs::path& dir) {
  const fs::path old = dir.parent_path() / ("." + dir.filename().string() + ".old");
  std::error_code ec;
  const bool replacing = fs::exists(dir, ec);
  if (replacing) {
    fs::remove_all(old, ec);  // a leftover from an earlier crash whose step-N is in place (recover_replaced)
    fs::rename(dir, old, ec);
    if (ec)
      throw IoError(fmt::format("state: cannot move the earlier save {} aside ({}); it is untouched", dir.string(),
                                ec.message()));
  }
  fs::rename(tmp, dir, ec);
  if (ec) {
    const std::string why = ec.message();
    std::string fate = "no earlier save of this step existed";
    if (replacing) {
      fs::rename(old, dir, ec);
      fate = ec ? fmt::format("the earlier save of this step is kept as {} ({})", old.string(), ec.message())
                : fmt::format("the earlier save {} is back in place", dir.string());
    }
    throw IoError(fmt::format("state: cannot rename {} to {} ({}); {}", tmp.string(), dir.string(), why, fate));
  }
  fsync_dir(dir.parent_path());
  if (!replacing) return;
  spdlog::info("state: replaced the earlier save of {}; removing it ({})", dir.filename().string(), old.string());
  fs::remove_all(old, ec);
  if (ec) spdlog::warn("state: could not remove {} ({}); delete it by hand", old.string(), ec.message());
}

void recover_replaced(const fs::path& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return;
  std::vector<fs::path> olds;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (n.size() == 18 && n[0] == '.' && step_of(n.substr(1, 13)) >= 0 && n.compare(14, 4, ".old") == 0)
      olds.push_back(e.path());
  }
  for (const auto& old : olds) {
    const fs::path dir = root / old.filename().string().substr(1, 13);
    if (fs::exists(dir, ec)) {
      spdlog::info("state: {} was replaced by a complete save; removing the old copy {}", dir.string(), old.string());
      fs::remove_all(old, ec);
    } else {
      spdlog::warn("state: a save of {} was cut short while replacing it; putting the earlier save back from {}",
                   dir.string(), old.string());
      fs::rename(old, dir, ec);
      if (ec)
        throw IoError(fmt::format("state: cannot rename {} back to {} ({})", old.string(), dir.string(), ec.message()));
    }
  }
}

std::vector<fs::path> set_aside_other_trajectories(const fs::path& root, const Found& resumed) {
  std::vector<fs::path> moved;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return moved;
  std::vector<fs::path> other;
  for (const auto& e : fs::directory_iterator(root)) {
    const int64_t step = step_of(e.path().filename().string());
    if (step > resumed.step || (step == resumed.step && !fs::equivalent(e.path(), resumed.dir, ec)))
      other.push_back(e.path());
  }
  std::sort(other.begin(), other.end());
  const fs::path aside = root / "abandoned";
  for (const auto& dir : other) {
    fs::create_directories(aside, ec);
    fs::path to = aside / dir.filename();
    for (int k = 2; fs::exists(to, ec); ++k) to = aside / fmt::format("{}-{}", dir.filename().string(), k);
    fs::rename(dir, to, ec);
    if (ec)
      throw IoError(fmt::format("state: cannot move {} (not on the resumed trajectory) to {} ({})", dir.string(),
                                to.string(), ec.message()));
    spdlog::warn(
        "--resume from step {}: {} is from a trajectory this run abandons; moved to {} (delete it when no longer "
        "needed)",
        resumed.step, dir.string(), to.string());
    moved.push_back(to);
  }
  const bool here = fs::equivalent(resumed.dir.parent_path(), root, ec);
  if (here && read_latest(root) != resumed.dir.filename().string()) {
    write_file_atomic(root / "latest", resumed.dir.filename().string() + "\n");
    fsync_dir(root);
  } else if (!here && !moved.empty() && fs::exists(root / "latest", ec)) {
    fs::remove(root / "latest", ec);
    fsync_dir(root);
  }
  return moved;
}

int64_t final_weights_step(const fs::path& file) {
  std::error_code ec;
  if (!fs::exists(file, ec)) return -1;
  const SafetensorsFile f(file);
  const auto it = f.metadata().find("sublinear_step");
  if (it == f.metadata().end()) return -1;  // not written by a trainer (or by an older one)
  const char* end = it->second.data() + it->second.size();
  int64_t step = -1;
  const auto [ptr, err] = std::from_chars(it->second.data(), end, step);
  return err == std::errc() && ptr == end && step >= 0 ? step : -1;
}

namespace {

// Moves directory `from` to `to`: a rename, or across file systems (a state.dir on another disk) a copy
// and then the removal of `from`. IoError naming both on failure (a partial copy is removed; `from` stays).
void move_dir(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (!ec) return;
  if (ec == std::errc::cross_device_link) {
    fs::copy(from, to, fs::copy_options::recursive, ec);
    if (!ec) {
      fs::remove_all(from, ec);
      if (!ec) return;
    } else {
      std::error_code ignored;
      fs::remove_all(to, ignored);
    }
  }
  throw IoError(fmt::format("state: cannot move {} to {} ({})", from.string(), to.string(), ec.message()));
}

}  // namespace

fs::path set_aside_final_weights(const fs::path& run_dir, const fs::path& root, const Found& resumed) {
  const fs::path model = run_dir / "model";
  int64_t step = -1;
  try {
    step = final_weights_step(model / "model.safetensors");
  } catch (const std::exception& e) {  // unreadable: export and sample ignore it too (with their own warning)
    spdlog::warn("--resume: cannot read the step of the final weights in {} ({}); left in place", model.string(),
                 e.what());
    return {};
  }
  std::error_code ec;
  const bool here = fs::equivalent(resumed.dir.parent_path(), root, ec);
  if (step < 0 || step < resumed.step || (step == resumed.step && here)) return {};
  const fs::path aside = root / "abandoned";
  fs::create_directories(aside, ec);
  fs::path to = aside / ("model-" + step_dir_name(step));
  for (int k = 2; fs::exists(to, ec); ++k) to = aside / fmt::format("model-{}-{}", step_dir_name(step), k);
  move_dir(model, to);
  fsync_dir(run_dir);
  spdlog::warn(
      "--resume from step {}: the final weights {} (step {}) are from a trajectory this run abandons; moved to {} "
      "(trainer export and sample now read this run's weights; delete it when no longer needed)",
      resumed.step, model.string(), step, to.string());
  return to;
}

Found find_local(const std::string& resume, const fs::path& root) {
  return resume == config::kResumeNewest ? find_auto(root) : find_path(resume);
}

fs::path step_dir(const fs::path& root, int64_t step) { return root / step_dir_name(step); }

fs::path state_root(const config::StateConfig& st, const fs::path& run_dir) {
  return st.dir.empty() ? run_dir / "state" : fs::path(st.dir);
}

const std::vector<std::string>& math_keys() {
  static const std::vector<std::string> keys = {"model.arch",
                                                "model.n_layer",
                                                "model.n_head",
                                                "model.n_embd",
                                                "model.vocab_size",
                                                "model.max_seq_len",
                                                "model.mlp_hidden",
                                                "model.layer_mlp_hidden",
                                                "model.dropout",
                                                "model.bias",
                                                "model.tie_embeddings",
                                                "model.norm_eps",
                                                "model.rope_theta",
                                                "model.init_std",
                                                "data.source",
                                                "data.raw_dtype",
                                                "data.path",
                                                "data.val_path",
                                                "data.val_fraction",
                                                "data.synthetic_tokens",
                                                "train.seq_len",
                                                "train.global_batch",
                                                "train.lr",
                                                "train.min_lr",
                                                "train.warmup_steps",
                                                "train.weight_decay",
                                                "train.beta1",
                                                "train.beta2",
                                                "train.grad_clip",
                                                "train.seed",
                                                "precision.compute",
                                                "precision.param_dtype",
                                                "precision.reduce_dtype",
                                                "precision.loss_scale",
                                                "precision.init_scale",
                                                "precision.growth_factor",
                                                "precision.backoff_factor",
                                                "precision.growth_interval"};
  return keys;
}

void check_recipe(const Json& meta, const config::RunConfig& cfg) {
  const Json saved = meta.at("math");
  const Json now = math_values(config::to_json(cfg), global_batch(cfg.train, cfg.mesh()));
  std::string diffs;
  for (const auto& key : math_keys())
    // newer keys: not compared
    if (saved.contains(key) && canonical(key, saved.at(key)) != canonical(key, now.at(key)))
      diffs += fmt::format("{}{} (saved {}, now {})", diffs.empty() ? "" : "; ", key,
                           saved.value(key, Json(nullptr)).dump(), now.at(key).dump());
  if (!diffs.empty())
    throw ConfigError(fmt::format("--resume: the recipe changes the math of the saved run: {}. Use the saved values "
                                  "(the state's meta.json holds its recipe), or start a new run",
                                  diffs));
}

Found find_state(const std::string& resume, const fs::path& root, parallel::Comm& comm) {
  Found f;
  int code = kExitOk;
  std::string error;
  if (comm.rank() == 0) {
    try {
      f = find_local(resume, root);
    } catch (const Error& e) {
      code = e.code, error = e.what();
    }
  }
  // Rank 0 chose; a failure there is every rank's, with its exit code and message.
  comm.fail_together(code, error, "--resume choice");
  if (comm.world() == 1) return f;
  const double step = comm.all_reduce_max(static_cast<double>(f.step), "--resume choice");  // -1: none found
  if (comm.rank() != 0 && step >= 0) {
    f.step = static_cast<int64_t>(step);
    f.dir = chosen_dir(resume, root, f.step);
    std::ifstream in(f.dir / "meta.json");
    f.meta = Json::parse(in);
  }
  return f;
}

namespace {

fs::path tmp_dir(const fs::path& root, int64_t step) { return root / ("." + step_dir_name(step) + ".tmp"); }

Saved saved_result(const fs::path& root, int64_t step, const std::vector<double>& digests, int64_t world,
                   Clock::time_point t0) {
  Saved out{root / step_dir_name(step), 0, 0};
  for (int64_t r = 0; r < world; ++r) out.bytes += static_cast<int64_t>(digests[static_cast<size_t>(3 * r + 1)]);
  out.ms = log::ms_since(t0);
  return out;
}

// A host copy of every tensor of this rank's file (device::HostSnapshot: the host pool; on CUDA one
// page-locked block whose copies may still be in flight), into `reuse`'s buffers when they fit (the
// previous snapshot: the same dtypes and sizes in the same order). `bytes`: the tensors' bytes.
device::HostSnapshot host_snapshot(const Named& tensors, device::HostSnapshot reuse, int64_t& bytes) {
  std::vector<at::Tensor> src;
  src.reserve(tensors.size());
  bytes = 0;
  for (const auto& [name, t] : tensors) {
    src.push_back(t.contiguous());  // so the writer thread copies nothing (it allocates in no pool)
    bytes += static_cast<int64_t>(t.nbytes());
  }
  return device::HostSnapshot::take(src, std::move(reuse));
}

// SUBLINEAR_STATE_WRITE_DELAY_MS: the asynchronous writer waits this long after writing its file before
// it reports done (a test hook: it holds a save in flight, its rank file complete and meta.json not
// yet written, long enough for a test to kill the run inside it). 0 when unset.
int64_t write_delay_ms() {
  const char* v = std::getenv("SUBLINEAR_STATE_WRITE_DELAY_MS");
  int64_t ms = 0;
  if (v != nullptr) std::from_chars(v, v + std::strlen(v), ms);
  return std::max<int64_t>(0, ms);
}

}  // namespace

Saved save(Parts& s, const Counters& st) {
  const auto t0 = Clock::now();
  const fs::path root = state_root(s.cfg.state, s.run_dir);
  const fs::path tmp = tmp_dir(root, st.steps_done);
  on_rank0_together(s, "state directory", [&] { make_fresh_dir(root, tmp); });
  std::string error;
  const auto mine = write_rank_file(tmp, s.launch.rank, rank_tensors(s, st), error);
  const auto digests = agree_on_files(s, mine, error, tmp);
  on_rank0_together(s, "state publish", [&] { publish(s, meta_content(s, st), st.steps_done, root, tmp, digests); });
  return saved_result(root, st.steps_done, digests, s.world(), t0);
}

// The thread that writes this rank's file from the snapshot, and what it leaves for finish().
struct AsyncSave::Writer {
  fs::path root, tmp;
  int64_t rank = 0;
  int64_t keep = 0;    // rank 0, after a save published without pruning: state.keep, applied first
  std::string newest;  // ... keeping this state (the newest published)
  Json content;  // rank 0: meta.json's content at the snapshot
  std::vector<std::string> names;  // of the snapshot's tensors
  device::HostSnapshot snapshot;
  Clock::time_point t0;
  std::vector<double> mine{0.0, 0.0, 0.0};
  std::string error;
  std::atomic<bool> finished{false};
  std::thread thread;

  void run() {
    prune_earlier();
    mine = write_snapshot();
    if (const int64_t ms = write_delay_ms()) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    finished.store(true, std::memory_order_release);
  }
  void join() {
    if (thread.joinable()) thread.join();
  }
  // This rank's file from the snapshot, once its copies have landed (on CUDA the one wait of the save).
  std::vector<double> write_snapshot() {
    try {
      snapshot.wait();
    } catch (const std::exception& e) {
      error = fmt::format("the snapshot's copies to host memory failed: {}", e.what());
      return {0.0, 0.0, 0.0};
    }
    Named named;
    named.reserve(names.size());
    for (size_t i = 0; i < names.size(); ++i) named.emplace_back(names[i], snapshot.tensors()[i]);
    return write_rank_file(tmp, rank, named, error);
  }
  // The earlier save's state.keep, off the loop (deleting a large state takes a while); a failure is a
  // warning, the next publication prunes again.
  void prune_earlier() {
    if (keep <= 0) return;
    try {
      prune(root, keep, newest);
    } catch (const std::exception& e) {
      spdlog::warn("state.keep {}: could not remove an older state ({}); the next save tries again", keep, e.what());
    }
  }
};

AsyncSave::AsyncSave(Parts& s, const Counters& st, AsyncSave* previous)
    : step_(st.steps_done), writer_(std::make_unique<Writer>()) {
  Writer& w = *writer_;
  w.t0 = Clock::now();
  w.root = state_root(s.cfg.state, s.run_dir);
  w.tmp = tmp_dir(w.root, step_);
  w.rank = s.launch.rank;
  on_rank0_together(s, "state directory", [&] { make_fresh_dir(w.root, w.tmp); });
  if (s.rank0()) w.content = meta_content(s, st);
  device::HostSnapshot reuse;
  if (previous != nullptr) {
    previous->writer_->join();
    reuse = std::move(previous->writer_->snapshot);
    if (s.rank0() && !previous->pruned_) w.keep = s.cfg.state.keep, w.newest = step_dir_name(previous->step_);
  }
  take_snapshot(s, st, std::move(reuse));
  snapshot_ms_ = log::ms_since(w.t0);
  w.thread = std::thread([&w] { w.run(); });
}

// The host snapshot, agreed over ranks (a collective): one rank out of host memory (rank 0 of a
// replicated run holds the whole model's) fails every rank, with exit 4 naming the snapshot.
void AsyncSave::take_snapshot(Parts& s, const Counters& st, device::HostSnapshot reuse) {
  int code = kExitOk;
  std::string error;
  auto refused = [&](const std::string& why) {
    code = kExitOom;
    error = fmt::format("out of host memory for the asynchronous save's snapshot of step {} ({}). Raise "
                        "memory.host_limit, or set state.async: false to write the state without a snapshot",
                        st.steps_done, why.substr(0, 300));
    writer_->snapshot = device::HostSnapshot();
  };
  try {
    const Named tensors = rank_tensors(s, st);
    writer_->names.clear();
    for (const auto& [name, t] : tensors) writer_->names.push_back(name);
    writer_->snapshot = host_snapshot(tensors, std::move(reuse), snapshot_bytes_);
  } catch (const c10::OutOfMemoryError& e) {  // memory.host_limit, or the system refusing pinned memory
    refused(e.what_without_backtrace());
  } catch (const c10::AcceleratorError&) {  // a device fault in the copies: not host memory, reported as itself
    throw;
  } catch (const c10::Error& e) {  // the CPU allocator refusing without the tracking allocator
    refused(e.what_without_backtrace());
  } catch (const std::bad_alloc& e) {
    refused(e.what());
  }
  try {
    s.comm->fail_together(code, error, "state snapshot");
  } catch (...) {
    std::error_code ec;
    if (s.rank0()) fs::remove_all(writer_->tmp, ec);  // nothing of this save is left behind
    throw;
  }
}

AsyncSave::~AsyncSave() { writer_->join(); }

bool AsyncSave::done() const { return writer_->finished.load(std::memory_order_acquire); }

Saved AsyncSave::finish(Parts& s, bool last) {
  Writer& w = *writer_;
  w.join();
  const auto digests = agree_on_files(s, w.mine, w.error, w.tmp);
  on_rank0_together(s, "state publish", [&] { publish(s, w.content, step_, w.root, w.tmp, digests, last); });
  pruned_ = last;
  return saved_result(w.root, step_, digests, s.world(), w.t0);
}

void AsyncSave::apply_keep(Parts& s) {
  if (pruned_ || !s.rank0()) return;
  writer_->keep = s.cfg.state.keep;
  writer_->newest = step_dir_name(step_);
  writer_->prune_earlier();
  pruned_ = true;
}

std::unique_ptr<AsyncSave> begin_save(Parts& s, const Counters& st, std::unique_ptr<AsyncSave> previous) {
  return std::make_unique<AsyncSave>(s, st, previous.get());
}

void load(const Found& found, Parts& s, Counters& st) {
  const Reader reader(found.dir, found.meta);
  for (const auto& part : components(s, st)) part->load(found.meta, reader);
  on_rank0_together(s, "setting aside the abandoned states", [&] {
    const fs::path root = state_root(s.cfg.state, s.run_dir);
    set_aside_other_trajectories(root, found);
    set_aside_final_weights(s.run_dir, root, found);
  });
}

void check_model_shapes(const Found& f, const config::ModelConfig& m) {
  const Reader r(f.dir, f.meta);
  for (const auto& [name, shape] : param_shapes(m)) {
    const int64_t saved = r.saved_elements("param", name), now = c10::multiply_integers(shape);
    if (saved < 0 || saved == now) continue;
    throw StateFileError(fmt::format(
        "--resume: parameter {} has {} elements in the saved state but {} in the recipe's model (shape [{}]): the "
        "saved run built another model. model.vocab_multiple changes the rows of wte and lm_head (model.vocab_size {} "
        "padded to {} here); resume with the saved run's model.vocab_multiple (its meta.json holds the recipe), or "
        "start a new run (model.init_from takes its exported weights)",
        name, saved, now, fmt::join(shape, ", "), m.vocab_size, m.padded_vocab()));
  }
}

}  // namespace sl::state
