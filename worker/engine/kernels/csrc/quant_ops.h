// kv_quantize(x, xq, scales, biases, group_size, bits, rounds): a KV block row's affine groups
// refit to its values, as KVQuant.quantize (kv_cache.py) computes it with MLX ops, bit for bit.
//
// From mx.quantize's integers and map (xq, scales, biases), per group of group_size values:
// `rounds` times the least-squares line through the (integer, value) points, then every value
// rounded again to the nearest integer of that line (half to even, clipped to [0, 2^bits - 1]);
// last, the line through the final integers. Outputs: the integers packed as mx.quantize packs
// them (uint32, element e in bits (e * bits) % 32 of word (e * bits) / 32) and the float32
// scales and biases. One primitive where the MLX ops are ~45 per call (each a task on the
// stream: ~0.9 ms for a decode step's rows of one layer's keys). The same operations in the
// same order as those MLX ops: sums one float at a time from 0 (the x86-64 wheel's reductions),
// a mean as the sum times 1 / group_size, no fused multiply-add (-ffp-contract=off).
#pragma once

#include "cpu_ops.h"

namespace mlxq {

std::vector<mx::array> kv_quantize(
    const mx::array& x,
    const mx::array& xq,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    int rounds);

class KVQuantizeOp : public CpuPrimitive {
 public:
  KVQuantizeOp(mx::Stream stream, int group_size, int bits, int rounds)
      : CpuPrimitive(stream), group_size_(group_size), bits_(bits), rounds_(rounds) {}
  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqKVQuantize";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const KVQuantizeOp&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && rounds_ == o.rounds_;
  }

 private:
  int group_size_, bits_, rounds_;
};

} // namespace mlxq
