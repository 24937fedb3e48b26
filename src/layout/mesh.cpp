// The process mesh (layout/mesh.h).
#include "layout/mesh.h"

#include <string>

#include "errors.h"

namespace sl::layout {

Mesh::Mesh(int64_t world, int64_t rank, Degrees degrees) : world_(world), rank_(rank), degrees_(degrees) {
  if (world_ < 1) throw ConfigError("WORLD_SIZE: " + std::to_string(world_) + " ranks; it must be at least 1");
  if (rank_ < 0 || rank_ >= world_)
    throw ConfigError("RANK: " + std::to_string(rank_) + " is not in [0, WORLD_SIZE = " + std::to_string(world_) + ")");
  if (degrees_.sequence < 1) throw ConfigError("parallel.sequence: must be >= 1");
  if (!fits(world_, degrees_))
    throw ConfigError("parallel.sequence: " + std::to_string(degrees_.sequence) + " does not divide WORLD_SIZE = " +
                      std::to_string(world_) + ": pick a degree that divides it");
}

std::vector<int64_t> Mesh::sequence_group() const {
  std::vector<int64_t> out;
  for (int64_t s = 0; s < sequence(); ++s) out.push_back(rank_of(data_rank(), s));
  return out;
}

std::vector<int64_t> Mesh::data_group() const {
  std::vector<int64_t> out;
  for (int64_t d = 0; d < data(); ++d) out.push_back(rank_of(d, sequence_rank()));
  return out;
}

}  // namespace sl::layout
