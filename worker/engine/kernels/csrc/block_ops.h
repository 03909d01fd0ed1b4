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
