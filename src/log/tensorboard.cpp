// TensorBoard event files: CRC-32C, TFRecord framing, the tag table, the event-file writer.
#include "log/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>

#include <fmt/format.h>

#include "errors.h"
#include "log/record_file.h"
#include "log/tensorboard_event.pb.h"  // generated from tensorboard_event.proto at build time

namespace sl::log {

namespace {

constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  std::string h(buf);
  for (char& c : h)
    if (c == '/') c = '_';
  return h;
}

constexpr const char* kPrefix = "events.out.tfevents.";

bool is_event_file(const std::filesystem::path& p) { return p.filename().string().rfind(kPrefix, 0) == 0; }

// A name for this process's event file in `dir` that sorts after every event file there:
// events.out.tfevents.<unix seconds>.<host>.<pid>, the seconds raised past the last file's when the
// clock says otherwise (a resume within the same second, a clock set back).
std::string next_event_file_name(const std::filesystem::path& dir) {
  std::string last;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (is_event_file(e.path())) last = std::max(last, e.path().filename().string());
  int64_t secs = static_cast<int64_t>(unix_seconds());
  const std::string rest = fmt::format(".{}.{}", host_name(), ::getpid());
  std::string name = fmt::format("{}{}{}", kPrefix, secs, rest);
  if (!last.empty() && name <= last) {
    int64_t last_secs = 0;
    const std::string tail = last.substr(std::strlen(kPrefix));
    for (char c : tail.substr(0, tail.find('.'))) {
      if (c < '0' || c > '9') break;
      last_secs = last_secs * 10 + (c - '0');
    }
    name = fmt::format("{}{}{}", kPrefix, std::max(secs, last_secs + 1), rest);
  }
  return name;
}

// The step-record fields mirrored under train/ and memory/ (their metrics.jsonl names).
constexpr const char* kTrainFields[] = {"loss", "lr", "grad_norm", "loss_scale", "step_ms", "tokens_per_s", "mfu"};
constexpr const char* kMemoryFields[] = {"peak_allocated_bytes", "allocated_bytes", "activation_peak_bytes"};

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = kCrc32cTable[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_le(out, data.size(), 8);
  put_le(out, masked_crc32c(out.data(), 8), 4);
  out.append(data);
  put_le(out, masked_crc32c(data.data(), data.size()), 4);
  return out;
}

std::vector<TensorBoardScalar> tensorboard_scalars(const nlohmann::json& record) {
  std::vector<TensorBoardScalar> out;
  if (!record.is_object()) return out;
  if (record.contains("event")) {
    if (record["event"] == "eval" && record.contains("val_loss") && record["val_loss"].is_number())
      out.push_back({"val/loss", record["val_loss"].get<double>()});
    return out;
  }
  for (const char* f : kTrainFields)
    if (record.contains(f) && record[f].is_number())
      out.push_back({fmt::format("train/{}", f), record[f].get<double>()});
  for (const char* f : kMemoryFields)
    if (record.contains(f) && record[f].is_number())
      out.push_back({fmt::format("memory/{}", f), record[f].get<double>()});
  if (record.contains("host_peak_bytes") && record["host_peak_bytes"].is_number() &&
      record["host_peak_bytes"].get<double>() != 0)
    out.push_back({"memory/host_peak_bytes", record["host_peak_bytes"].get<double>()});
  return out;
}

TensorBoardWriter::TensorBoardWriter(const std::filesystem::path& dir, int64_t resume_step) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw ConfigError(fmt::format("logging.tensorboard: cannot create {} ({})", dir.string(), ec.message()));
  if (resume_step < 0) {
    std::vector<std::filesystem::path> earlier;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec))
      if (is_event_file(e.path())) earlier.push_back(e.path());
    for (const auto& p : earlier)
      if (!ec) std::filesystem::remove(p, ec);
    if (ec)
      throw ConfigError(fmt::format("logging.tensorboard: cannot clear the earlier event files in {} ({})",
                                    dir.string(), ec.message()));
  }
  path_ = dir / next_event_file_name(dir);
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw ConfigError(fmt::format("logging.tensorboard: cannot create {} ({})", path_.string(), errno_text(errno)));
  tbproto::Event version;
  version.set_wall_time(unix_seconds());
  version.set_file_version("brain.Event:2");
  append(version.SerializeAsString());
  // Every file opens a session: TensorBoard's Python loader takes its first START for the run's start
  // and each later one for a restart that drops what it holds at and after the START's step.
  tbproto::Event start;
  start.set_wall_time(unix_seconds());
  start.set_step(std::max<int64_t>(resume_step, 0) + 1);
  start.mutable_session_log()->set_status(tbproto::SessionLog::START);
  append(start.SerializeAsString());
}

TensorBoardWriter::~TensorBoardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardWriter::write(const nlohmann::json& record) {
  if (!record.is_object() || !record.contains("step") || !record["step"].is_number_integer()) return;
  const auto scalars = tensorboard_scalars(record);
  if (!scalars.empty()) write_scalars(record["step"].get<int64_t>(), scalars);
}

void TensorBoardWriter::write_scalars(int64_t step, const std::vector<TensorBoardScalar>& scalars) {
  tbproto::Event ev;
  ev.set_wall_time(unix_seconds());
  ev.set_step(step);
  auto* summary = ev.mutable_summary();
  for (const auto& s : scalars) {
    auto* v = summary->add_value();
    v->set_tag(s.tag);
    v->set_simple_value(static_cast<float>(s.value));
  }
  append(ev.SerializeAsString());
}

void TensorBoardWriter::append(const std::string& event_bytes) {
  const std::string rec = tfrecord(event_bytes);
  if (const auto f = append_record(fd_, written_, rec))
    throw IoError(fmt::format("writing {} failed: {}; the {} bytes written before {} (free disk space, choose another "
                              "logging.dir, or set logging.tensorboard: false)",
                              path_.string(), errno_text(f.err), written_,
                              f.cut ? "stay whole records" : "may end in a partial record"));
}

}  // namespace sl::log
