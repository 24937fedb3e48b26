// safetensors writing (atomic, checked, CRC-32 while writing: log/files.h) and reading (mmap, every
// offset checked).
#include "state/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <functional>
#include <optional>
#include <stdexcept>
#include <system_error>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace sl::state {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; so must the host be");

namespace {

constexpr int64_t kMaxHeaderBytes = 100'000'000;  // the reference reader's limit

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

// The dtypes this project stores, with their safetensors names.
struct DtypeName {
  at::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {{at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kBFloat16, "BF16"},
                                 {at::kHalf, "F16"},  {at::kLong, "I64"},   {at::kInt, "I32"},
                                 {at::kByte, "U8"},   {at::kBool, "BOOL"}};

const char* dtype_name(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  return nullptr;
}

std::optional<at::ScalarType> dtype_from_name(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  return std::nullopt;
}

}  // namespace

namespace {

// Checks the tensors of write_safetensors (any device: the writer stages them to host itself).
void check_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) throw std::invalid_argument(fmt::format("write_safetensors: tensor {} is undefined", name));
    if (t.layout() != at::kStrided)
      throw std::invalid_argument(fmt::format("write_safetensors: tensor {} is not a dense (strided) tensor", name));
  }
}

// The header JSON padded with spaces to a multiple of 8 bytes; offsets follow the given order.
std::string build_header(const std::vector<SafetensorsWriter::Spec>& specs,
                         const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const auto& sp : specs) {
    const int64_t bytes = sp.nbytes();
    h[sp.name] = {{"dtype", dtype_name(sp.dtype)}, {"shape", sp.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text;
  try {
    text = h.dump();
  } catch (const nlohmann::json::exception& e) {  // a name or value that is not UTF-8
    throw std::invalid_argument(fmt::format("write_safetensors: header not encodable: {}", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

void check_specs(const std::vector<SafetensorsWriter::Spec>& specs) {
  std::vector<std::string> names;
  for (const auto& sp : specs) {
    if (sp.name == "__metadata__") throw std::invalid_argument("write_safetensors: the name __metadata__ is reserved");
    if (!dtype_name(sp.dtype))
      throw std::invalid_argument(
          fmt::format("write_safetensors: tensor {} has unsupported dtype {}", sp.name, c10::toString(sp.dtype)));
    names.push_back(sp.name);
  }
  std::sort(names.begin(), names.end());
  if (auto dup = std::adjacent_find(names.begin(), names.end()); dup != names.end())
    throw std::invalid_argument(fmt::format("write_safetensors: tensor name {} appears twice", *dup));
}

// A corrupt-file finding, turned into a StateFileError naming the file by the constructor.
struct Corrupt {
  std::string what;
};

uint64_t json_offset(const nlohmann::json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  throw Corrupt{"holds a value that is not a non-negative integer"};
}

std::vector<int64_t> parse_shape(const std::string& name, const nlohmann::json& shape) {
  if (!shape.is_array()) throw Corrupt{fmt::format("tensor {}: shape is not an array", name)};
  std::vector<int64_t> dims;
  for (const auto& d : shape) {
    if (!d.is_number_integer() || (d.is_number_unsigned() ? d.get<uint64_t>() > INT64_MAX : d.get<int64_t>() < 0))
      throw Corrupt{
          fmt::format("tensor {}: shape {} has a dimension that is not a non-negative integer", name, shape.dump())};
    dims.push_back(d.get<int64_t>());
  }
  return dims;
}

// Bytes the shape and dtype need; throws Corrupt on overflow.
uint64_t expected_bytes(const SafetensorsFile::Entry& e) {
  uint64_t n = c10::elementSize(e.dtype);
  for (int64_t d : e.shape)
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n))
      throw Corrupt{fmt::format("tensor {}: shape overflows", e.name)};
  return n;
}

// One header entry, checked against the size of the data area.
SafetensorsFile::Entry parse_entry(const std::string& name, const nlohmann::json& v, uint64_t data_bytes) {
  if (!v.is_object()) throw Corrupt{fmt::format("tensor {}: entry is not an object", name)};
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!v.contains(key)) throw Corrupt{fmt::format("tensor {}: entry has no {}", name, key)};
  SafetensorsFile::Entry e;
  e.name = name;
  const auto& dtype = v.at("dtype");
  const auto type = dtype.is_string() ? dtype_from_name(dtype.get<std::string>()) : std::nullopt;
  if (!type) throw Corrupt{fmt::format("tensor {}: unknown dtype {}", name, dtype.dump())};
  e.dtype = *type;
  e.shape = parse_shape(name, v.at("shape"));
  const auto& offs = v.at("data_offsets");
  if (!offs.is_array() || offs.size() != 2)
    throw Corrupt{fmt::format("tensor {}: data_offsets is not [begin, end]", name)};
  uint64_t begin, end;
  try {
    begin = json_offset(offs[0]), end = json_offset(offs[1]);
  } catch (const Corrupt& c) {
    throw Corrupt{fmt::format("tensor {}: data_offsets {} {}", name, offs.dump(), c.what)};
  }
  if (end < begin) throw Corrupt{fmt::format("tensor {}: data_offsets {} end before begin", name, offs.dump())};
  if (end > data_bytes)
    throw Corrupt{fmt::format("tensor {}: data_offsets {} run past the data area ({} bytes; file truncated?)", name,
                              offs.dump(), data_bytes)};
  if (end - begin != expected_bytes(e))
    throw Corrupt{fmt::format("tensor {}: {} bytes in data_offsets {}, but dtype {} and shape {} need {}", name,
                              end - begin, offs.dump(), dtype.get<std::string>(), v.at("shape").dump(),
                              expected_bytes(e))};
  e.begin = static_cast<int64_t>(begin);
  e.end = static_cast<int64_t>(end);
  return e;
}

std::map<std::string, std::string> parse_metadata(const nlohmann::json& m) {
  if (!m.is_object()) throw Corrupt{"__metadata__ is not an object"};
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : m.items()) {
    if (!v.is_string()) throw Corrupt{fmt::format("__metadata__ value of {} is not a string", k)};
    out[k] = v.get<std::string>();
  }
  return out;
}

// Sorts the entries by offset and checks that they tile the data area exactly: no overlap, no gap,
// nothing after the last tensor (the reference reader refuses all three).
void check_tiling(std::vector<SafetensorsFile::Entry>& entries, int64_t data_bytes) {
  std::stable_sort(entries.begin(), entries.end(),
                   [](const auto& a, const auto& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  int64_t covered = 0;
  const SafetensorsFile::Entry* prev = nullptr;
  for (const auto& e : entries) {
    if (e.begin < covered)
      throw Corrupt{fmt::format("tensor {} (bytes {}..{}) overlaps tensor {} (bytes {}..{})", e.name, e.begin, e.end,
                                prev->name, prev->begin, prev->end)};
    if (e.begin > covered)
      throw Corrupt{
          fmt::format("bytes {}..{} of the data area before tensor {} belong to no tensor", covered, e.begin, e.name)};
    covered = e.end;
    prev = &e;
  }
  if (covered != data_bytes)
    throw Corrupt{fmt::format("data area has {} bytes but the tensors cover {}", data_bytes, covered)};
}

}  // namespace

void for_each_host_chunk(const at::Tensor& t, const std::function<void(const void*, size_t)>& sink) {
  if (t.numel() == 0) return;
  if (t.device().is_cpu()) {  // written from its own memory (a contiguous copy first when strided)
    const at::Tensor c = t.contiguous();
    sink(c.const_data_ptr(), c.nbytes());
    return;
  }
  // Device tensor: a contiguous flat view on the device (one device copy when strided), then bounded
  // pieces copied to host one at a time (.to(kCPU) waits for its copy, so the piece is filled when
  // sink reads it; each is freed before the next is made).
  const at::Tensor flat = t.contiguous().reshape({-1});
  const int64_t item = static_cast<int64_t>(flat.element_size());
  const int64_t per_piece = std::max<int64_t>(1, device::kHostStagingBytes / item);
  for (int64_t pos = 0; pos < flat.numel(); pos += per_piece) {
    const int64_t n = std::min(per_piece, flat.numel() - pos);
    const at::Tensor piece = flat.narrow(0, pos, n).to(at::kCPU).contiguous();
    sink(piece.const_data_ptr(), static_cast<size_t>(n * item));
  }
}

int64_t SafetensorsWriter::Spec::nbytes() const {
  int64_t n = static_cast<int64_t>(c10::elementSize(dtype));
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsWriter::SafetensorsWriter(const std::filesystem::path& path, std::vector<Spec> specs,
                                     const std::map<std::string, std::string>& metadata)
    : specs_(std::move(specs)) {
  check_specs(specs_);
  const std::string header = build_header(specs_, metadata);
  const uint64_t header_len = header.size();
  file_ = std::make_unique<AtomicFile>(path);
  file_->write(&header_len, sizeof(header_len));
  file_->write(header.data(), header.size());
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::append(const at::Tensor& t) {
  if (next_ >= specs_.size()) throw std::logic_error("SafetensorsWriter: more tensors than the header lists");
  const Spec& sp = specs_[next_];
  if (!t.defined() || t.layout() != at::kStrided || t.scalar_type() != sp.dtype || t.sizes().vec() != sp.shape)
    throw std::logic_error(fmt::format("SafetensorsWriter: tensor {} does not match its header entry", sp.name));
  for_each_host_chunk(t, [&](const void* data, size_t n) { file_->write(data, n); });
  ++next_;
}

FileDigest SafetensorsWriter::commit() {
  if (next_ != specs_.size())
    throw std::logic_error(fmt::format("SafetensorsWriter: {} of {} tensors written", next_, specs_.size()));
  return file_->commit();
}

FileDigest write_safetensors(const std::filesystem::path& path,
                             const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                             const std::map<std::string, std::string>& metadata) {
  check_tensors(tensors);
  std::vector<SafetensorsWriter::Spec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  SafetensorsWriter out(path, std::move(specs), metadata);
  for (const auto& named : tensors) out.append(named.second);
  return out.commit();
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : path_(path) {
  map_file();
  try {
    parse_header();
  } catch (const Corrupt& c) {
    throw StateFileError(fmt::format("{} is not a valid safetensors file: {}", path_.string(), c.what));
  }
}

SafetensorsFile::~SafetensorsFile() = default;

// Maps the whole file read-only; a file too short to hold the header length is refused first.
void SafetensorsFile::map_file() {
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw StateFileError(fmt::format("cannot open {}: {}", path_.string(), errno_text(errno)));
  struct stat st {};
  const int err_stat = ::fstat(fd, &st) != 0 ? errno : S_ISREG(st.st_mode) ? 0 : EINVAL;
  if (err_stat) {
    const int err = err_stat;
    ::close(fd);
    throw StateFileError(fmt::format("cannot read {}: {}", path_.string(), errno_text(err)));
  }
  size_ = st.st_size;
  if (size_ < 8) {
    ::close(fd);
    throw StateFileError(
        fmt::format("{} is not a valid safetensors file: {} bytes, shorter than the 8-byte header length "
                    "(truncated?)",
                    path_.string(), size_));
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) throw StateFileError(fmt::format("cannot map {}: {}", path_.string(), errno_text(err)));
  const auto bytes = static_cast<size_t>(size_);
  map_ = std::shared_ptr<const uint8_t>(static_cast<const uint8_t*>(p),
                                        [bytes](const uint8_t* q) { ::munmap(const_cast<uint8_t*>(q), bytes); });
}

void SafetensorsFile::parse_header() {
  uint64_t n = 0;
  std::memcpy(&n, map_.get(), sizeof(n));
  if (n > static_cast<uint64_t>(size_ - 8))
    throw Corrupt{fmt::format("header length {} runs past the end of the file ({} bytes; truncated?)", n, size_)};
  if (n > static_cast<uint64_t>(kMaxHeaderBytes))
    throw Corrupt{fmt::format("header length {} is over the {} byte limit", n, kMaxHeaderBytes)};
  data_start_ = 8 + static_cast<int64_t>(n);
  const char* text = reinterpret_cast<const char*>(map_.get()) + 8;
  const auto h = nlohmann::json::parse(text, text + n, nullptr, /*allow_exceptions=*/false);
  if (h.is_discarded()) throw Corrupt{"header is not valid JSON"};
  if (!h.is_object()) throw Corrupt{"header is not a JSON object"};
  const auto data_bytes = static_cast<uint64_t>(size_ - data_start_);
  for (const auto& [key, value] : h.items()) {
    if (key == "__metadata__")
      metadata_ = parse_metadata(value);
    else
      entries_.push_back(parse_entry(key, value, data_bytes));
  }
  check_tiling(entries_, static_cast<int64_t>(data_bytes));
}

const SafetensorsFile::Entry* SafetensorsFile::find(const std::string& name) const {
  for (const auto& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

at::Tensor SafetensorsFile::view(const std::string& name) const {
  const Entry* e = find(name);
  if (!e) throw StateFileError(fmt::format("{} has no tensor named {}", path_.string(), name));
  auto* data = const_cast<uint8_t*>(map_.get() + data_start_ + e->begin);
  const auto options = at::TensorOptions().dtype(e->dtype).device(at::kCPU);
  const auto item = c10::elementSize(e->dtype);
  if (reinterpret_cast<uintptr_t>(data) % item != 0) {  // misaligned: an aligned copy
    auto copy = at::empty(e->shape, options);
    std::memcpy(copy.data_ptr(), data, static_cast<size_t>(e->end - e->begin));
    return copy;
  }
  return at::from_blob(data, e->shape, [keep = map_](void*) {}, options);
}

uint32_t SafetensorsFile::crc32() const { return state::crc32(map_.get(), static_cast<size_t>(size_)); }

}  // namespace sl::state
