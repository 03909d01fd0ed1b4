// categorical(logits, inv_temp, u) -> (B,) uint32: one draw per row from
// softmax(logits * inv_temp), by inverse CDF with the row's own uniform u.
//
// Why an op: the x86-64 mlx wheel computes exp and log one float at a time
// (~13 ns each), so Gumbel-max sampling (two logs per vocabulary entry, plus
// the random bits) and the logsumexp in front of it took ~0.2 ms per row and
// step: 1.5 ms of a decode step for the 8 samples of an n = 8 job on an
// 8k vocabulary. This reads each row twice with an 8-lane exp and needs one
// uniform per row, which the sampler derives from (seed, sample, step) on the
// host (worker/engine/sampler.py), so a row's draw depends on nothing but its
// own logits and key: not on its batch, its thread or its neighbours.
#pragma once

#include "cpu_ops.h"

namespace mlxq {

mx::array categorical(const mx::array& logits, const mx::array& inv_temp, const mx::array& u);

// argmax(logits (B, V) float32) -> (B,) uint32, as mx.argmax(logits, axis=-1) (the first of
// equal maxima), 8 lanes at a time: MLX's CPU argmax compares one float at a time (0.58 ms for
// 64 rows of an 8k vocabulary, ~2% of a batch-64 decode step of the bench model).
mx::array argmax(const mx::array& logits);

// "avx2" or "generic": the loop this CPU runs.
const char* categorical_isa();

class Argmax : public CpuPrimitive {
 public:
  explicit Argmax(mx::Stream stream) : CpuPrimitive(stream) {}
  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqArgmax";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

class Categorical : public CpuPrimitive {
 public:
  explicit Categorical(mx::Stream stream) : CpuPrimitive(stream) {}
  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqCategorical";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

} // namespace mlxq
