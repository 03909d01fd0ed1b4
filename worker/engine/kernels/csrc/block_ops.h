#pragma once

#include <vector>

#include "cpu_ops.h"

namespace mlxq {

// The second half of a llama/qwen2 decoder layer after the attention, as one primitive:
//   h1 = h + o_proj(o);  x = rms_norm(h1);  gate, up = gate_proj(x), up_proj(x)
//   out = h1 + down_proj(swiglu(gate, up))
// Each step is the task of the op the model file would run (linear_run, rms_norm_run,
// swiglu_run, a float add), on the same inputs in the same order, so `out` is bit for bit
// what those ops give one after another; what goes is MLX's dispatch, an output buffer and a
// graph node per op (six a layer). biases: o, gate, up, down, each std::nullopt where absent.
mx::array mlp_block(
    const mx::array& h,
    const mx::array& o,
    const mx::array& w_o,
    const mx::array& norm_weight,
    float eps,
    const mx::array& w_gate,
    const mx::array& w_up,
    const mx::array& w_down,
    const std::vector<std::optional<mx::array>>& biases);

// The first half of a llama/qwen2 decoder layer at one token a row, as one primitive:
//   x = rms_norm(h);  q, k, v = q_proj(x), k_proj(x), v_proj(x)
//   q, k = rope(q as (B, heads, 1, hd)), rope(k as (B, kv_heads, 1, hd));  v as (B, kv_heads, 1, hd)
// h is (B, 1, D); offsets (B,) or a scalar: each row's position. The same tasks as those ops
// (rms_norm_run, linear_run, rope_run), so the same bits. biases: q, k, v, all or none.
std::vector<mx::array> attn_in(
    const mx::array& h,
    const mx::array& norm_weight,
    float eps,
    const std::vector<mx::array>& ws,
    const std::vector<mx::array>& biases,
    int heads,
    int kv_heads,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offsets);

class AttnIn : public CpuPrimitive {
 public:
  AttnIn(mx::Stream stream, float eps, bool has_bias, int dims, bool traditional, float base, float scale)
      : CpuPrimitive(stream),
        eps_(eps),
        has_bias_(has_bias),
        dims_(dims),
        traditional_(traditional),
        base_(base),
        scale_(scale) {}
  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqAttnIn";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AttnIn&>(other);
    return eps_ == o.eps_ && has_bias_ == o.has_bias_ && dims_ == o.dims_ && traditional_ == o.traditional_ &&
        base_ == o.base_ && scale_ == o.scale_;
  }

 private:
  float eps_;
  bool has_bias_;
  int dims_;
  bool traditional_;
  float base_, scale_;
};

class MlpBlock : public CpuPrimitive {
 public:
  MlpBlock(mx::Stream stream, float eps, unsigned bias_mask)
      : CpuPrimitive(stream), eps_(eps), bias_mask_(bias_mask) {}
  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqMlpBlock";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const MlpBlock&>(other);
    return eps_ == o.eps_ && bias_mask_ == o.bias_mask_;
  }

 private:
  float eps_;
  unsigned bias_mask_; // bit i: biases[i] given (o, gate, up, down)
};

} // namespace mlxq
