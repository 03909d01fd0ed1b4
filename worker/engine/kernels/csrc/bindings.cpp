// Python bindings of the paged attention primitive. NB_DOMAIN mlx (set in
// CMakeLists.txt) shares nanobind's type registry with mlx.core, so mx.array
// crosses over; mlx.core must be imported before this module.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <stdexcept>

#include "block_ops.h"
#include "cpu_ops.h"
#include "linear_ops.h"
#include "norm_ops.h"
#include "paged_attention.h"
#include "qlinear_ops.h"
#include "quant_ops.h"
#include "sample_ops.h"
#include "thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_mlxq_paged_attention, m) {
  m.doc() = "mlxq CPU primitives: paged attention, the paged KV write, swiglu, rope, rms_norm, linear, categorical, argmax";
  m.def(
      "paged_attention",
      [](const mx::array& queries,
         const mx::array& k_pool,
         const mx::array& v_pool,
         const mx::array& block_tables,
         const mx::array& q_offsets,
         const mx::array& kv_lens,
         float scale,
         std::optional<int> window,
         int block_size,
         std::optional<mx::array> k_scales,
         std::optional<mx::array> k_biases,
         std::optional<mx::array> v_scales,
         std::optional<mx::array> v_biases,
         int bits,
         int group_size) {
        std::optional<mlxq::KVQuantArrays> quant;
        if (bits != 0) {
          if (!k_scales || !k_biases || !v_scales || !v_biases)
            throw std::invalid_argument(
                "paged_attention: quantized pools need k_scales, k_biases, v_scales and v_biases");
          quant = mlxq::KVQuantArrays{*k_scales, *k_biases, *v_scales, *v_biases, bits, group_size};
        }
        return mlxq::paged_attention(
            queries,
            k_pool,
            v_pool,
            block_tables,
            q_offsets,
            kv_lens,
            scale,
            window.value_or(0),
            block_size,
            quant);
      },
      "queries"_a,
      "k_pool"_a,
      "v_pool"_a,
      "block_tables"_a,
      "q_offsets"_a,
      "kv_lens"_a,
      "scale"_a,
      "window"_a = nb::none(),
      "block_size"_a = 32,
      nb::kw_only(),
      "k_scales"_a = nb::none(),
      "k_biases"_a = nb::none(),
      "v_scales"_a = nb::none(),
      "v_biases"_a = nb::none(),
      "bits"_a = 0,
      "group_size"_a = 0,
      "Attention over KV blocks read in place from the pools (quantized ones with "
      "bits, group_size and the scales/biases); see paged_attention.h.");
  m.def(
      "swiglu",
      &mlxq::swiglu,
      "gate"_a,
      "up"_a,
      "silu(gate) * up, float32, bit-identical to mlx-lm's swiglu on the CPU.");
  m.def(
      "rope",
      &mlxq::rope,
      "x"_a,
      "dims"_a,
      "traditional"_a,
      "base"_a,
      "scale"_a,
      "offset"_a,
      "mx.fast.rope for float32 (B, H, T, D), bit-identical to MLX's CPU RoPE.");
  m.def(
      "rms_norm",
      &mlxq::rms_norm,
      "x"_a,
      "weight"_a,
      "eps"_a,
      "mx.fast.rms_norm for float32, bit-identical to MLX's CPU path, as one primitive.");
  m.def(
      "linear",
      &mlxq::linear,
      "x"_a,
      "w"_a,
      "bias"_a = nb::none(),
      "x (..., K) @ w (N, K)^T (+ bias), float32, split over the pool's threads: our own "
      "loops where the CPU has AVX2+FMA (linear_isa), else single-threaded BLAS calls (set_blas).");
  m.def(
      "attn_in",
      &mlxq::attn_in,
      "h"_a,
      "norm_weight"_a,
      "eps"_a,
      "ws"_a,
      "biases"_a,
      "heads"_a,
      "kv_heads"_a,
      "dims"_a,
      "traditional"_a,
      "base"_a,
      "scale"_a,
      "offsets"_a,
      "qscales"_a = std::vector<mx::array>{},
      "qbiases"_a = std::vector<mx::array>{},
      "group_size"_a = 0,
      "bits"_a = 0,
      "int8_dot"_a = false,
      "A llama/qwen2 layer's first half at one token a row, one primitive: x = rms_norm(h (B, 1, D)); "
      "q, k, v = linear_group(x, ws, biases); [rope(q as (B, heads, 1, hd)), rope(k as (B, kv_heads, 1, "
      "hd)), v as (B, kv_heads, 1, hd)]. Bit for bit those ops one after another. With qscales and qbiases "
      "(q, k, v), ws are packed: quantized_linear_group(x, ws, qscales, qbiases, group_size, bits, int8_dot) "
      "instead of linear_group (biases: none).");
  m.def(
      "mlp_block",
      &mlxq::mlp_block,
      "h"_a,
      "o"_a,
      "w_o"_a,
      "norm_weight"_a,
      "eps"_a,
      "w_gate"_a,
      "w_up"_a,
      "w_down"_a,
      "biases"_a,
      "qscales"_a = std::vector<mx::array>{},
      "qbiases"_a = std::vector<mx::array>{},
      "group_size"_a = 0,
      "bits"_a = 0,
      "int8_dot"_a = false,
      "A llama/qwen2 layer after its attention, one primitive: h1 = h + linear(o, w_o); out = h1 + "
      "linear(swiglu(*linear_group(rms_norm(h1, norm_weight, eps), [w_gate, w_up])), w_down); biases "
      "[o, gate, up, down], each an array or None. Bit for bit those ops one after another. With qscales and "
      "qbiases (o, gate, up, down), the weights are packed: quantized_linear(_group) with group_size, bits and "
      "int8_dot for each linear(_group) (biases: all None).");
  m.def(
      "linear_group",
      &mlxq::linear_group,
      "x"_a,
      "ws"_a,
      "biases"_a = std::vector<mx::array>{},
      "[x @ w^T (+ bias) for each w]: one primitive, one pass of the pool; each output bit for "
      "bit linear(x, w, bias).");
  m.def("set_blas", &mlxq::set_blas, "sgemm"_a, "sgemv"_a, "set_threads"_a, "get_threads"_a,
        "Addresses of cblas_sgemm, cblas_sgemv, openblas_set_num_threads and "
        "openblas_get_num_threads (0: none) in the process's BLAS, for linear.");
  m.def(
      "paged_kv_write",
      &mlxq::paged_kv_write,
      "k_pool"_a,
      "v_pool"_a,
      "keys"_a,
      "values"_a,
      "slots"_a,
      "[k_pool', v_pool']: keys (B, H, N, D) written at pool rows slots (B*N,).");
  m.def(
      "kv_quantize",
      &mlxq::kv_quantize,
      "x"_a,
      "xq"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      "rounds"_a,
      "[packed, scales, biases]: mx.quantize's groups of x (float32) refit by least squares and "
      "rounded again `rounds` times, then refit (KVQuant.quantize's MLX ops, bit for bit).");
  m.def("kv_write_copies", &mlxq::kv_write_copies,
        "paged_kv_write evaluations that copied their pool instead of writing in place.");
  m.def("kv_write_waits", &mlxq::kv_write_waits,
        "paged_kv_write evaluations that waited for the reads queued ahead of them on "
        "the stream, then wrote in place (cpu_ops.cpp, writable_in_place).");
  m.def(
      "quantized_linear",
      &mlxq::quantized_linear,
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      "int8_dot"_a = false,
      "x @ dequantize(w, scales, biases)^T for float32 x (..., K) and MLX's affine 4- or 8-bit weight "
      "(N, K * bits / 32) uint32 with float32 scales and biases (N, K / group_size), read as stored; "
      "each output in one summation order whatever the batch. int8_dot: x rounded to 8 bits per block "
      "of 32 and integer dot products (llama.cpp's method; qdot.h), not the fp32 path's bits.");
  m.def(
      "quantized_linear_group",
      &mlxq::quantized_linear_group,
      "x"_a,
      "ws"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      "int8_dot"_a = false,
      "[quantized_linear(x, ws[i], scales[i], biases[i], group_size, bits, int8_dot)] as one primitive and "
      "one pass of the pool, each output bit for bit its own call.");
  m.def("qlinear_isa", &mlxq::qlinear_isa, "The quantized_linear loops this CPU runs: avx2 or generic.");
  m.def("qdot_isa", &mlxq::qdot_isa,
        "The loops quantized_linear's int8_dot runs on this CPU: avx-vnni, avx2 or generic (the same bits).");
  m.def("linear_isa", &mlxq::linear_isa,
        "The loops linear runs: avx512vl or avx2 (our own, the same bits either way), or blas.");
  m.def("swiglu_isa", &mlxq::swiglu_isa, "The swiglu loop this CPU runs: avx2 or generic.");
  m.def(
      "categorical",
      &mlxq::categorical,
      "logits"_a,
      "inv_temp"_a,
      "u"_a,
      "(B,) uint32: row b drawn from softmax(logits[b] * inv_temp[b]) by inverse CDF with its "
      "uniform u[b] in [0, 1); -inf logits are never drawn.");
  m.def(
      "argmax",
      &mlxq::argmax,
      "logits"_a,
      "(B,) uint32: mx.argmax(logits, axis=-1) for float32 (B, V), 8 lanes at a time.");
  m.def("categorical_isa", &mlxq::categorical_isa, "The categorical loop this CPU runs: avx2 or generic.");
  m.def("num_threads", &mlxq::num_threads, "Threads the op runs on.");
  m.def("isa", &mlxq::isa, "The attention inner loop this CPU runs: avx512vl, avx2 or generic.");
}
