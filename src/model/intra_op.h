// Work split over ATen's intra-op threads, for the fused CPU kernels (attention, GELU, AdamW, the
// residual adds, LayerNorm).
//
// at::parallel_for cannot do it from here: it is a header template whose `#pragma omp parallel` is
// compiled into the calling file, and this project is built without OpenMP (libtorch brings its own
// runtime), so it would run on one thread. A TensorIterator's for_each splits inside libtorch instead.
#pragma once
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <torch/types.h>

namespace sl::model {

// Runs fn(i, tid) once for every i in [0, n), on ATen's intra-op threads; tid (< at::get_num_threads())
// indexes per-thread scratch. Which thread takes which i varies; what fn computes for i must not.
template <class Fn>
void for_each_index(int64_t n, Fn fn) {
  const auto index = torch::arange(n, torch::kLong);
  auto iter = at::TensorIteratorConfig().add_const_input(index).build();
  iter.for_each([&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
    TORCH_INTERNAL_ASSERT(size1 == 1);  // a 1-D iterator
    const int tid = at::get_thread_num();
    for (int64_t k = 0; k < size0; ++k) fn(*reinterpret_cast<const int64_t*>(data[0] + k * strides[0]), tid);
  }, /*grain_size=*/1);
}

// Runs kernel(ptrs, n) over same-shaped contiguous tensors of one dtype, element-aligned pieces on
// ATen's intra-op threads: ptrs holds the outputs' then the inputs' pointers to a piece's first
// element, n its length. For elementwise kernels (each element computed on its own, so the split and
// the thread count change no bit).
template <class Kernel>
void for_each_piece(std::initializer_list<torch::Tensor> outputs, std::initializer_list<torch::Tensor> inputs,
                    int64_t grain, Kernel kernel) {
  at::TensorIteratorConfig config;
  for (const auto& t : outputs) {
    TORCH_INTERNAL_ASSERT(t.is_contiguous());
    config.add_output(t);
  }
  for (const auto& t : inputs) {
    TORCH_INTERNAL_ASSERT(t.is_contiguous());
    config.add_const_input(t);
  }
  auto iter = config.check_all_same_dtype(true).resize_outputs(false).build();
  const int nt = iter.ntensors();
  TORCH_INTERNAL_ASSERT(nt <= 8);
  iter.for_each([&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
    for (int64_t j = 0; j < size1; ++j) {
      char* ptrs[8] = {};
      for (int t = 0; t < nt; ++t) ptrs[t] = data[t] + j * strides[nt + t];
      kernel(ptrs, size0);  // contiguous operands: unit inner strides
    }
  }, grain);
}

// Pieces of several flat arrays (array k has sizes[k] elements), at most `piece` elements each, array
// by array in order: one parallel pass over many tensors (gradient clipping, AdamW: for_each_index
// over the pieces) in place of one pass (and one thread launch) per tensor.
struct ArrayPiece {
  int64_t array, begin, size;
};
inline std::vector<ArrayPiece> pieces_of_arrays(const std::vector<int64_t>& sizes, int64_t piece) {
  std::vector<ArrayPiece> out;
  for (int64_t k = 0; k < static_cast<int64_t>(sizes.size()); ++k)
    for (int64_t b = 0; b < sizes[k]; b += piece) out.push_back({k, b, std::min(piece, sizes[k] - b)});
  return out;
}

// Row pieces, for the kernels whose backward sums a column total (a bias's or a norm weight's
// gradient) over the rows of x seen as (rows, C): kRowPiece rows per task, each piece summing into its
// own row of a (pieces_of(rows), C) fp32 tensor of partial sums, which sum_pieces then adds in piece
// order. So the bits depend on neither the thread count nor which thread took which piece.
constexpr int64_t kRowPiece = 32;

inline int64_t pieces_of(int64_t rows) { return (rows + kRowPiece - 1) / kRowPiece; }

// Runs fn(r, piece) for every row r in [0, rows), a piece of rows per task.
template <class Fn>
void for_each_row(int64_t rows, Fn fn) {
  for_each_index(pieces_of(rows), [&](int64_t c, int) {
    for (int64_t r = c * kRowPiece; r < std::min(rows, (c + 1) * kRowPiece); ++r) fn(r, c);
  });
}

// The partial sums' rows (pieces, C), fp32, added in order into one (C) row (from 0).
inline torch::Tensor sum_pieces(const torch::Tensor& partial) {
  const int64_t pieces = partial.size(0), C = partial.size(1);
  auto out = torch::zeros({C}, partial.options());
  const float* P = partial.const_data_ptr<float>();
  float* O = out.data_ptr<float>();
  for (int64_t c = 0; c < pieces; ++c)
    for (int64_t j = 0; j < C; ++j) O[j] += P[c * C + j];
  return out;
}

}  // namespace sl::model
