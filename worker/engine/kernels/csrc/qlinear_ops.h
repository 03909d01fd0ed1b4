// quantized_linear(x, w, scales, biases, group_size, bits): x @ dequantize(w)^T for float32 x and
// a weight in MLX's affine quantization as stored (nn.QuantizedLinear's weight, scales, biases;
// from a GGUF Q4_0/Q4_1/Q8_0 file: 4 or 8 bits, group 32), read as it is (qmatmul.h), split over
// output columns on the extension's thread pool. A decode step at few rows is bound by the bytes
// of weights it reads: 4-bit weights are ~5x fewer bytes than their fp32 copy (with fp32 scales
// and biases per group of 32: 6 bits a weight; 8-bit: 10).
//
// Bit for bit linear() on the weights as MLX's dequantize widens them (the cpu_weights=fp32 path)
// where linear runs its own loops (AVX2 + FMA): each weight (s * q) + b, each output summed in
// linear's order, the same in any batch (qmatmul.h). Without AVX2 the generic loops give those
// bits too, but linear then calls the BLAS, so the two paths differ by float32 rounding there.
#pragma once

#include <vector>

#include "cpu_ops.h"
#include "mlx/backend/cpu/encoder.h"
#include "qmatmul.h"

namespace mlxq {

// The loops quantized_linear runs: "avx2" (AVX2 + FMA) or "generic" (the same bits).
const char* qlinear_isa();
// The loops quantized_linear's int8_dot runs: "avx-vnni", "avx2" or "generic" (the same bits).
const char* qdot_isa();

// int8_dot: qdot.h's method instead (x rounded to 8 bits per block of 32, integer dot products): not
// linear()'s bits, still the same bits for a row in any batch.
mx::array quantized_linear(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, bool int8_dot = false);

// Several weights of one width and kind applied to one x as one primitive and one pass of the pool
// (a layer's q/k/v projections, an MLP's gate and up): each output bit for bit its own
// quantized_linear call; what it saves is the per-call cost (an MLX task, a wake-up of the pool).
std::vector<mx::array> quantized_linear_group(const mx::array& x, const std::vector<mx::array>& ws,
                                              const std::vector<mx::array>& scales,
                                              const std::vector<mx::array>& biases, int group_size, int bits,
                                              bool int8_dot = false);

// One packed weight of a call: its blocks and where its output goes (y: M rows of N).
struct QTarget {
  qmatmul::QWeight q;
  float* y;
  int N;
};

// What quantized_linear takes of a packed weight for x (..., K), or an invalid_argument naming `op`: float32
// scales and biases, or with int8_dot float16 or bfloat16 ones too (qmatmul.h's ScaleKind).
void check_packed(const char* op, const mx::array& w, const mx::array& scales, const mx::array& biases, int K,
                  int group_size, int bits, bool int8_dot);

// A packed weight (N, K * bits / 32) with its scales and biases (checked by check_packed) as a target,
// registered with the encoder; y is left for the caller to set.
QTarget qlinear_target(const mx::array& w, const mx::array& scales, const mx::array& biases, int K, int group_size,
                       int bits, mx::cpu::CommandEncoder& encoder);

// y = x @ dequantize(w)^T for every target (one bits), M rows of x (K wide, contiguous): QuantizedLinear's
// task, on the pool; a fused op that calls it gets each output bit for bit as quantized_linear() would.
void quantized_linear_run(const std::vector<QTarget>& targets, const float* x, int M, int K, bool int8_dot);

class QuantizedLinear : public CpuPrimitive {
 public:
  QuantizedLinear(mx::Stream stream, int group_size, int bits, int groups, bool int8_dot)
      : CpuPrimitive(stream), group_size_(group_size), bits_(bits), groups_(groups), int8_dot_(int8_dot) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqQuantizedLinear";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_, bits_, groups_;
  bool int8_dot_;
};

} // namespace mlxq
