// Precompiled header: the heavy third-party headers every translation unit includes.
#pragma once
#include <torch/torch.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <yaml-cpp/yaml.h>
#include <fmt/format.h>
#include <string>
#include <vector>
#include <map>
#include <functional>
