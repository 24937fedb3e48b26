#include "train/profile.h"

#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "errors.h"

namespace sl::train {

namespace prof = torch::profiler::impl;

StepProfiler::StepProfiler(bool on, torch::Device device) : on_(on) {
  if (!on_) return;
  std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
  if (device.is_cuda()) activities.insert(prof::ActivityType::CUDA);
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO, /*report_input_shapes=*/true);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
}

StepProfiler::~StepProfiler() {
  if (on_) torch::autograd::profiler::disableProfiler();
}

int64_t StepProfiler::save(const std::string& path) {
  if (!on_) return 0;
  on_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  const auto events = static_cast<int64_t>(result->events().size());
  const std::string tmp = path + ".tmp";
  try {
    result->save(tmp);
  } catch (const std::exception& e) {
    std::filesystem::remove(tmp);
    throw IoError(fmt::format("cannot write the profile {}: {}", path, e.what()));
  }
  std::error_code ec;
  if (!std::filesystem::exists(tmp, ec) || std::filesystem::file_size(tmp, ec) == 0) {
    std::filesystem::remove(tmp, ec);
    throw IoError(fmt::format("cannot write the profile {}: the profiler wrote nothing (disk full?)", path));
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw IoError(fmt::format("cannot write the profile {}: {}", path, ec.message()));
  return events;
}

}  // namespace sl::train
