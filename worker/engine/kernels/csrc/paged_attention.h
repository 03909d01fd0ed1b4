// Paged attention as an MLX primitive (CPU).
//
//   paged_attention(queries (B, Hq, N, D), k_pool (Hkv, S, Dk),
//                   v_pool (Hkv, S, Dv), block_tables (B, nb) int32,
//                   q_offsets (B,) int32, kv_lens (B,) int32, scale,
//                   window = 0) -> (B, Hq, N, Dv)
//
// S = num_blocks * block_size. Query n of row b sits at position
// q_offsets[b] + n and attends the keys at positions j with
// j <= q_offsets[b] + n, j < kv_lens[b] and, with a window w > 0,
// j > q_offsets[b] + n - w. Key j of row b is pool row
// block_tables[b][j / block_size] * block_size + j % block_size.
// Query head h reads KV head h / (Hq / Hkv) (GQA, KV heads not repeated).
// Queries that see no key (padding) give zeros.
//
// Quantized pools (quant set): k_pool/v_pool are mx.quantize's packed uint32
// rows (Hkv, S, D * bits / 32), the scales/biases (Hkv, S, D / group_size) of
// one float dtype; the kernel reads the packed integers and applies each group's
// scale and bias to the dot products and the weights (as MLX's quantized matmul).
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlxq {

struct KVQuantArrays {
  mx::array k_scales, k_biases, v_scales, v_biases;
  int bits; // 4 or 8
  int group_size; // divides both head dims, a multiple of 32
};

mx::array paged_attention(
    const mx::array& queries,
    const mx::array& k_pool,
    const mx::array& v_pool,
    const mx::array& block_tables,
    const mx::array& q_offsets,
    const mx::array& kv_lens,
    float scale,
    int window = 0,
    int block_size = 32,
    const std::optional<KVQuantArrays>& quant = std::nullopt);

// "avx512vl", "avx2" or "generic": the inner loop this CPU runs.
const char* isa();

class PagedAttention : public mx::Primitive {
 public:
  PagedAttention(
      mx::Stream stream,
      float scale,
      int window,
      int block_size,
      int bits = 0,
      int group_size = 0)
      : mx::Primitive(stream),
        scale_(scale),
        window_(window),
        block_size_(block_size),
        bits_(bits),
        group_size_(group_size) {}

  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  void eval_gpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "MlxqPagedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  int window_;
  int block_size_;
  int bits_; // 0: float pools
  int group_size_;
};

} // namespace mlxq
