// rms_norm(x, weight, eps): mx.fast.rms_norm for float32, bit-identical to MLX's CPU path.
//
// On the CPU, MLX has no RMSNorm kernel: mx.fast.rms_norm builds its fallback graph
// (square, sum, the 1/n multiply, add eps, rsqrt, two multiplies and their
// broadcasts: ~10 primitives, each dispatched as a task of its own). A decode step
// of a llama has 2 norms per layer plus the final one, so on a small model they were
// ~150 of a step's ~680 primitives. This is one primitive computing the same
// operations in the same order: the row's sum of squares accumulated one float at
// a time from 0 (the x86-64 wheel's reduction has SIMD width 1), times float(1/D),
// plus eps, 1 / sqrt, x * r, then * weight. No fused multiply-add (compiled with
// -ffp-contract=off). x may be strided (read in place); the output is row-contiguous.
// Eight rows go side by side, each its own chain of adds (so the same bits).
#pragma once

#include "cpu_ops.h"

namespace mlxq {

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps);

// RMSNormOp's task: rows of D floats (row r at xp + starts[r], element stride xs) into op (rows
// contiguous), weight at stride ws; on the pool where large. For fused ops: the same bits.
void rms_norm_run(const float* xp, const int64_t* starts, int64_t xs, const float* wp, int64_t ws, float* op,
                  int64_t rows, int64_t D, float eps);

// The same over contiguous rows (row r at xp + r * D), as the fused ops hold them.
void rms_norm_rows_run(const float* xp, const float* wp, int64_t ws, float* op, int64_t rows, int64_t D,
                       float eps);

class RMSNormOp : public CpuPrimitive {
 public:
  RMSNormOp(mx::Stream stream, float eps) : CpuPrimitive(stream), eps_(eps) {}
  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqRMSNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNormOp&>(other).eps_;
  }

 private:
  float eps_;
};

} // namespace mlxq
