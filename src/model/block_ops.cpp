// The block's ops (model/block_ops.h): each branch's linears through the recompute hook, and the
// biases routed to the fused kernels that take them.
#include "model/block_ops.h"

#include "model/gelu.h"
#include "model/residual.h"

namespace sl::model {

PendingNorm BlockOps::norm1(const torch::Tensor& x) const {
  return {Part::norm1_qkv, [block = &b_](const auto& in) { return block->norm1(in[0]); }, x, {b_.ln1_w, b_.ln1_b}};
}

PendingNorm BlockOps::norm2(const torch::Tensor& h) const {
  return {Part::norm2_fc, [block = &b_](const auto& in) { return block->norm2(in[0]); }, h, {b_.ln2_w, b_.ln2_b}};
}

torch::Tensor BlockOps::linear(const PendingNorm& n, const torch::Tensor& W, const torch::Tensor& b) const {
  return linear_after_(n.part, n.norm, {n.x}, n.params, W, b);
}

Branch BlockOps::attention(const PendingNorm& n) const {
  const auto qkv = linear(n, b_.w_qkv, b_.b_qkv);  // (B, T, 3C)
  const auto bias = residual_bias(n.x, b_.b_proj);  // the stream the branch is added to is the norm's input
  const auto core = [block = &b_](const auto& in) { return block->attention_core(in); };  // (B, T, C)
  const auto y = linear_after_(Part::attention_proj, core, b_.attention_inputs(qkv, rope_), {}, b_.w_proj,
                               bias.defined() ? torch::Tensor() : b_.b_proj);
  return {y, bias};
}

Branch BlockOps::mlp(const PendingNorm& n) const {
  // GPT-2's fc bias goes into the fused GELU where it runs on the fc's output.
  const auto act_bias = !b_.llama && gelu_tanh_bias_fused(n.x, b_.b_fc) ? b_.b_fc : torch::Tensor();
  const auto u = linear(n, b_.w_fc, act_bias.defined() ? torch::Tensor() : b_.b_fc);  // (B, T, H) or (B, T, 2H)
  const auto bias = residual_bias(n.x, b_.b_out);
  const auto act = [block = &b_, act_bias](const auto& in) { return block->mlp_act(in[0], act_bias); };  // (B, T, H)
  const auto y =
      linear_after_(Part::act_out, act, {u}, {act_bias}, b_.w_out, bias.defined() ? torch::Tensor() : b_.b_out);
  return {y, bias};
}

torch::Tensor BlockOps::residual(const torch::Tensor& stream, const Branch& branch) const {
  return residual_add(stream, b_.residual_dropout(branch.y), branch.bias);
}

torch::Tensor BlockOps::residual_bias(const torch::Tensor& stream, const torch::Tensor& b) const {
  const bool dropout_active = b_.is_training() && b_.dropout > 0.0;  // the bias goes in before the dropout
  return !dropout_active && residual_bias_fused(stream, b) ? b : torch::Tensor();
}

}  // namespace sl::model
