#pragma once

#include <vector>

#include "cpu_ops.h"

namespace mlxq {

// Packed projections (cpu_weights=quantized or int8-dot): each weight of a fused op is a
// quantized_linear weight, its scales and biases given beside it, one bits and group size for all;
// each projection then is quantized_linear_run's task, so bit for bit its own quantized_linear call.
// bits == 0: float32 weights (linear_run).
struct Packing {
  int group_size = 0, bits = 0;
  bool int8_dot = false;
  bool operator==(const Packing&) const = default;
};

// The second half of a llama/qwen2 decoder layer after the attention, as one primitive:
//   h1 = h + o_proj(o);  x = rms_norm(h1);  gate, up = gate_proj(x), up_proj(x)
//   out = h1 + down_proj(swiglu(gate, up))
// Each step is the task of the op the model file would run (linear_run, rms_norm_run,
// swiglu_run, a float add), on the same inputs in the same order, so `out` is bit for bit
// what those ops give one after another; what goes is MLX's dispatch, an output buffer and a
// graph node per op (six a layer). biases: o, gate, up, down, each std::nullopt where absent.
// qscales, qbiases (o, gate, up, down) with group_size and bits: the weights are packed (Packing),
// and biases all absent.
mx::array mlp_block(
    const mx::array& h,
    const mx::array& o,
    const mx::array& w_o,
    const mx::array& norm_weight,
    float eps,
    const mx::array& w_gate,
    const mx::array& w_up,
    const mx::array& w_down,
    const std::vector<std::optional<mx::array>>& biases,
    const std::vector<mx::array>& qscales = {},
    const std::vector<mx::array>& qbiases = {},
    int group_size = 0,
    int bits = 0,
    bool int8_dot = false);

// The first half of a llama/qwen2 decoder layer at one token a row, as one primitive:
//   x = rms_norm(h);  q, k, v = q_proj(x), k_proj(x), v_proj(x)
//   q, k = rope(q as (B, heads, 1, hd)), rope(k as (B, kv_heads, 1, hd));  v as (B, kv_heads, 1, hd)
// h is (B, 1, D); offsets (B,) or a scalar: each row's position. The same tasks as those ops
// (rms_norm_run, linear_run, rope_run), so the same bits. biases: q, k, v, all or none.
// qscales, qbiases (q, k, v) with group_size and bits: ws are packed (Packing), and biases none.
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
    const mx::array& offsets,
    const std::vector<mx::array>& qscales = {},
    const std::vector<mx::array>& qbiases = {},
    int group_size = 0,
    int bits = 0,
    bool int8_dot = false);

class AttnIn : public CpuPrimitive {
 public:
  AttnIn(mx::Stream stream, float eps, bool has_bias, int dims, bool traditional, float base, float scale,
         Packing packing)
      : CpuPrimitive(stream),
        eps_(eps),
        has_bias_(has_bias),
        dims_(dims),
        traditional_(traditional),
        base_(base),
        scale_(scale),
        packing_(packing) {}
  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqAttnIn";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AttnIn&>(other);
    return eps_ == o.eps_ && has_bias_ == o.has_bias_ && dims_ == o.dims_ && traditional_ == o.traditional_ &&
        base_ == o.base_ && scale_ == o.scale_ && packing_ == o.packing_;
  }

 private:
  float eps_;
  bool has_bias_;
  int dims_;
  bool traditional_;
  float base_, scale_;
  Packing packing_;
};

class MlpBlock : public CpuPrimitive {
 public:
  MlpBlock(mx::Stream stream, float eps, unsigned bias_mask, Packing packing)
      : CpuPrimitive(stream), eps_(eps), bias_mask_(bias_mask), packing_(packing) {}
  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqMlpBlock";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const MlpBlock&>(other);
    return eps_ == o.eps_ && bias_mask_ == o.bias_mask_ && packing_ == o.packing_;
  }

 private:
  float eps_;
  unsigned bias_mask_; // bit i: biases[i] given (o, gate, up, down)
  Packing packing_;
};

} // namespace mlxq
