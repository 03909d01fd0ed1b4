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

namespace mlxq {

// The loops quantized_linear runs: "avx2" (AVX2 + FMA) or "generic" (the same bits).
const char* qlinear_isa();

mx::array quantized_linear(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits);

// Several weights of one width and kind applied to one x as one primitive and one pass of the pool
// (a layer's q/k/v projections, an MLP's gate and up): each output bit for bit its own
// quantized_linear call; what it saves is the per-call cost (an MLX task, a wake-up of the pool).
std::vector<mx::array> quantized_linear_group(const mx::array& x, const std::vector<mx::array>& ws,
                                              const std::vector<mx::array>& scales,
                                              const std::vector<mx::array>& biases, int group_size, int bits);

class QuantizedLinear : public CpuPrimitive {
 public:
  QuantizedLinear(mx::Stream stream, int group_size, int bits, int groups)
      : CpuPrimitive(stream), group_size_(group_size), bits_(bits), groups_(groups) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqQuantizedLinear";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_, bits_, groups_;
};

} // namespace mlxq
