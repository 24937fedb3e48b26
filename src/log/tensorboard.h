// TensorBoard event files (logging.tensorboard): the scalars of metrics.jsonl's step records and eval
// events, written by rank 0 to <run dir>/tensorboard/events.out.tfevents.<unix seconds>.<host>.<pid>,
// the file name and record format TensorBoard's readers take (TFRecords holding tensorflow.Event
// protobufs, CRC-32C checked). The protobuf code stays in tensorboard.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace sl::log {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), continuing from `crc` (0 to start):
// crc32c("123456789") = 0xE3069283.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);
inline uint32_t crc32c(std::string_view s) { return crc32c(s.data(), s.size()); }
// The masked form TFRecords store: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t size);

// One TFRecord around `data`: uint64 length (little-endian), masked CRC-32C of those 8 bytes, the
// data, masked CRC-32C of the data.
std::string tfrecord(std::string_view data);

struct TensorBoardScalar {
  std::string tag;
  double value;  // stored as float32 (TensorBoard's simple_value)
};

// The scalars TensorBoard shows for one metrics.jsonl record (tags in docs/logs.md, "TensorBoard"):
// a step record gives train/<field> for loss, lr, grad_norm (not on a skipped step: it is null),
// loss_scale, step_ms, tokens_per_s, mfu, and memory/<field> for peak_allocated_bytes,
// allocated_bytes, activation_peak_bytes, and host_peak_bytes when it is not 0 (offload); an eval
// event gives val/loss; other events give nothing.
std::vector<TensorBoardScalar> tensorboard_scalars(const nlohmann::json& record);

// An event file of its own. Every record is written whole with one write (unbuffered: TensorBoard
// reads it while the run goes on); a failed write is cut off again, so the file ends with whole
// records, and throws IoError naming the file and the system error.
class TensorBoardWriter {
 public:
  // Opens a new event file in `dir` (created with its parents) named to sort after every event
  // file already there (TensorBoard reads a directory's files in name order), and writes the
  // file-version event. A fresh run (resume_step < 0) first deletes the event files an earlier run
  // left in `dir` (the run directory is being replaced: logging.overwrite). A resumed run keeps them
  // and writes a SessionLog START at step resume_step + 1 next, so TensorBoard drops the steps after
  // resume_step that the earlier files hold (the run replays them).
  // Throws ConfigError when `dir` or the file cannot be created, IoError when a first record cannot be
  // written.
  TensorBoardWriter(const std::filesystem::path& dir, int64_t resume_step);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // The record's scalars (tensorboard_scalars) as one event at the record's "step"; a record with no
  // scalars or no integer step writes nothing.
  void write(const nlohmann::json& record);
  // One event at `step` holding `scalars` as simple values.
  void write_scalars(int64_t step, const std::vector<TensorBoardScalar>& scalars);
  const std::filesystem::path& path() const { return path_; }

 private:
  void append(const std::string& event_bytes);  // one serialized Event as one TFRecord

  std::filesystem::path path_;
  int fd_ = -1;
  int64_t written_ = 0;  // bytes of whole records in the file
};

}  // namespace sl::log
