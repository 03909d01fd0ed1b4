// A decoder layer's post-attention half as one CPU primitive; see block_ops.h.
#include "block_ops.h"

#include <algorithm>
#include <optional>
#include <string>
#include <stdexcept>

#include "linear_ops.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "norm_ops.h"
#include "qlinear_ops.h"
#include "row_contiguous.h"
#include "thread_pool.h"

namespace mlxq {

namespace {

void check_weight(const mx::array& w, int N, int K, const char* what) {
  if (w.dtype() != mx::float32 || w.ndim() != 2 || w.shape(0) != N || w.shape(1) != K)
    throw std::invalid_argument(std::string("mlp_block: ") + what + " must be float32 (" + std::to_string(N) +
                                ", " + std::to_string(K) + ")");
}

// A fused op's projections: float32 weights (linear_run's targets) or packed ones (quantized_linear_run's).
struct Projections {
  std::vector<LinearTarget> f;
  std::vector<QTarget> q;
  bool int8_dot = false;

  // y = x @ w_i^T for the weights `which` names ({index, its y}), one call: each output bit for bit
  // what its own linear() or quantized_linear() call gives
  void run(std::initializer_list<std::pair<int, float*>> which, const float* x, int M, int K) const {
    if (!q.empty())
      quantized_linear_run(targets(q, which), x, M, K, int8_dot);
    else
      linear_run(targets(f, which), x, M, K);
  }

 private:
  // the weights `which` names, each with its y
  template <class Target>
  static std::vector<Target> targets(const std::vector<Target>& all,
                                     std::initializer_list<std::pair<int, float*>> which) {
    std::vector<Target> t;
    for (auto [i, y] : which) {
      t.push_back(all[i]);
      t.back().y = y;
    }
    return t;
  }
};

// How a fused op's weights come: float32 where no scales and biases are given (Packing's bits 0), else
// packed, each weight with its scales and biases checked as quantized_linear checks them, for its own K.
Packing packing_of(const char* op, const std::vector<mx::array>& ws, const std::vector<mx::array>& qscales,
                   const std::vector<mx::array>& qbiases, const std::vector<int>& ks, int group_size, int bits,
                   bool int8_dot) {
  if (qscales.empty() && qbiases.empty())
    return {};
  if (qscales.size() != ws.size() || qbiases.size() != ws.size())
    throw std::invalid_argument(std::string(op) + ": packed weights need a scales and a biases array each");
  for (size_t i = 0; i < ws.size(); ++i)
    check_packed(op, ws[i], qscales[i], qbiases[i], ks[i], group_size, bits, int8_dot);
  return {group_size, bits, int8_dot};
}

// h + y, elementwise (what MLX's add of two float32 arrays computes), on the pool where large.
void add_run(const float* h, const float* y, float* out, int64_t n) {
  split_ranges(pool(), n, n, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      out[i] = h[i] + y[i];
  });
}

} // namespace

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
    const std::vector<mx::array>& qscales,
    const std::vector<mx::array>& qbiases,
    int group_size,
    int bits,
    bool int8_dot) {
  if (!has_blas())
    throw std::runtime_error("attn_in: no BLAS set (set_blas)");
  if (h.dtype() != mx::float32 || h.ndim() != 3 || h.shape(1) != 1 || h.shape(2) == 0)
    throw std::invalid_argument("attn_in: h must be float32 (B, 1, D)");
  const int B = h.shape(0), D = h.shape(2);
  if (norm_weight.dtype() != mx::float32 || norm_weight.ndim() != 1 || norm_weight.shape(0) != D)
    throw std::invalid_argument("attn_in: norm_weight must be float32 (D,)");
  if (ws.size() != 3 || (!biases.empty() && biases.size() != 3))
    throw std::invalid_argument("attn_in: ws is [w_q, w_k, w_v]; biases the same three, or none");
  if (heads <= 0 || kv_heads <= 0)
    throw std::invalid_argument("attn_in: heads and kv_heads must be positive");
  const int hs[3] = {heads, kv_heads, kv_heads};
  const Packing packing = packing_of("attn_in", ws, qscales, qbiases, {D, D, D}, group_size, bits, int8_dot);
  if (packing.bits && !biases.empty())
    throw std::invalid_argument("attn_in: packed weights take no biases");
  std::vector<mx::Shape> shapes;
  for (int i = 0; i < 3; ++i) {
    const auto& w = ws[i];
    if (packing.bits ? w.shape(0) % hs[i] != 0
                     : (w.dtype() != mx::float32 || w.ndim() != 2 || w.shape(1) != D || w.shape(0) % hs[i] != 0))
      throw std::invalid_argument("attn_in: w_q, w_k, w_v must be float32 (heads * head_dim, D), or packed");
    if (!biases.empty() && (biases[i].dtype() != mx::float32 || biases[i].ndim() != 1 ||
                            biases[i].shape(0) != w.shape(0)))
      throw std::invalid_argument("attn_in: a bias must be float32 (N,) for its weight");
    shapes.push_back({B, hs[i], 1, w.shape(0) / hs[i]});
  }
  if (ws[0].shape(0) / heads != ws[1].shape(0) / kv_heads)
    throw std::invalid_argument("attn_in: queries and keys must have one head dim");
  std::vector<mx::array> inputs = {h, norm_weight, rope_offsets("attn_in", dims, ws[0].shape(0) / heads, offsets, B)};
  inputs.insert(inputs.end(), ws.begin(), ws.end());
  inputs.insert(inputs.end(), biases.begin(), biases.end());
  inputs.insert(inputs.end(), qscales.begin(), qscales.end());
  inputs.insert(inputs.end(), qbiases.begin(), qbiases.end());
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  auto prim = std::make_shared<AttnIn>(s, eps, !biases.empty(), dims, traditional, base, scale, packing);
  return mx::array::make_arrays(std::move(shapes), {mx::float32, mx::float32, mx::float32}, prim, std::move(inputs));
}

void AttnIn::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const mx::array h = row_contiguous(inputs[0], encoder);
  const mx::array off = row_contiguous(inputs[2], encoder);
  const auto& nw = inputs[1];
  encoder.set_input_array(h);
  encoder.set_input_array(nw);
  encoder.set_input_array(off);
  const int B = h.shape(0), D = h.shape(2);
  Projections proj;
  proj.int8_dot = packing_.int8_dot;
  for (int i = 0; i < 3; ++i) {
    if (packing_.bits)
      proj.q.push_back(qlinear_target(inputs[3 + i], inputs[6 + i], inputs[9 + i], D, packing_.group_size,
                                      packing_.bits, encoder));
    else
      proj.f.push_back(linear_target(inputs[3 + i], has_bias_ ? &inputs[6 + i] : nullptr, D, encoder));
    auto& out = outputs[i];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
  }
  float* vp = outputs[2].data<float>(); // v as the projection leaves it: (B, 1, kv_heads * hd) is (B, kv_heads, 1, hd)
  const int H = outputs[0].shape(1), KH = outputs[1].shape(1), hd = outputs[0].shape(3);
  const float* hp = h.data<float>();
  const float* wn = nw.data<float>();
  const int64_t wns = nw.strides()[0];
  const int32_t* op = off.data<int32_t>();
  const int n_off = off.size();
  float* qp = outputs[0].data<float>();
  float* kp = outputs[1].data<float>();
  const float eps = eps_, base = base_, scale = scale_;
  const int dims = dims_;
  const bool traditional = traditional_;
  encoder.dispatch([=]() {
    thread_local std::vector<float> buf;
    const int64_t nq = (int64_t)B * H * hd, nk = (int64_t)B * KH * hd;
    buf.resize((size_t)((int64_t)B * D + nq + nk));
    float* x = buf.data();
    float* q = x + (int64_t)B * D; // the projections before RoPE
    float* k = q + nq;
    rms_norm_rows_run(hp, wn, wns, x, B, D, eps);
    proj.run({{0, q}, {1, k}, {2, vp}}, x, B, D);
    // (B, 1, heads * hd) read as (B, heads, 1, hd): strides (heads * hd, hd, hd)
    rope_run(q, (int64_t)H * hd, hd, hd, B, H, 1, hd, op, n_off, dims, traditional, base, scale, qp);
    rope_run(k, (int64_t)KH * hd, hd, hd, B, KH, 1, hd, op, n_off, dims, traditional, base, scale, kp);
  });
}

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
    const std::vector<mx::array>& qscales,
    const std::vector<mx::array>& qbiases,
    int group_size,
    int bits,
    bool int8_dot) {
  if (!has_blas())
    throw std::runtime_error("mlp_block: no BLAS set (set_blas)");
  if (h.dtype() != mx::float32 || o.dtype() != mx::float32 || h.ndim() < 1 || o.ndim() < 1)
    throw std::invalid_argument("mlp_block: h and o must be float32");
  const int D = h.shape(-1), Ko = o.shape(-1), I = w_gate.ndim() == 2 ? w_gate.shape(0) : -1;
  if (D == 0 || Ko == 0 || I <= 0 || h.size() / D != o.size() / Ko)
    throw std::invalid_argument("mlp_block: h (..., D) and o (..., K) must have the same rows");
  const Packing packing = packing_of("mlp_block", {w_o, w_gate, w_up, w_down}, qscales, qbiases, {Ko, D, D, I},
                                     group_size, bits, int8_dot);
  if (packing.bits) {
    if (w_o.shape(0) != D || w_up.shape(0) != I || w_down.shape(0) != D)
      throw std::invalid_argument("mlp_block: packed w_o, w_gate, w_up, w_down must be (D, .), (I, .), (I, .), (D, .)");
    if (std::any_of(biases.begin(), biases.end(), [](const auto& b) { return b.has_value(); }))
      throw std::invalid_argument("mlp_block: packed weights take no biases");
  } else {
    check_weight(w_o, D, Ko, "w_o");
    check_weight(w_gate, I, D, "w_gate");
    check_weight(w_up, I, D, "w_up");
    check_weight(w_down, D, I, "w_down");
  }
  if (norm_weight.dtype() != mx::float32 || norm_weight.ndim() != 1 || norm_weight.shape(0) != D)
    throw std::invalid_argument("mlp_block: norm_weight must be float32 (D,)");
  if (biases.size() != 4)
    throw std::invalid_argument("mlp_block: biases is [o, gate, up, down], each an array or None");
  const int widths[4] = {D, I, I, D};
  std::vector<mx::array> inputs = {h, o, w_o, norm_weight, w_gate, w_up, w_down};
  unsigned mask = 0;
  for (int i = 0; i < 4; ++i) {
    if (!biases[i])
      continue;
    const auto& b = *biases[i];
    if (b.dtype() != mx::float32 || b.ndim() != 1 || b.shape(0) != widths[i])
      throw std::invalid_argument("mlp_block: a bias must be float32 (N,) for its weight");
    mask |= 1u << i;
    inputs.push_back(b);
  }
  inputs.insert(inputs.end(), qscales.begin(), qscales.end());
  inputs.insert(inputs.end(), qbiases.begin(), qbiases.end());
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  return mx::array(h.shape(), mx::float32, std::make_shared<MlpBlock>(s, eps, mask, packing), std::move(inputs));
}

void MlpBlock::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const mx::array h = row_contiguous(inputs[0], encoder);
  const mx::array o = row_contiguous(inputs[1], encoder);
  encoder.set_input_array(h);
  encoder.set_input_array(o);
  const int D = h.shape(-1), Ko = o.shape(-1), I = inputs[4].shape(0);
  const int M = (int)(h.size() / (size_t)D);
  const mx::array* b[4] = {nullptr, nullptr, nullptr, nullptr};
  for (int i = 0, next = 7; i < 4; ++i)
    if (bias_mask_ & (1u << i))
      b[i] = &inputs[next++];
  // o, gate, up, down
  const int at[4] = {2, 4, 5, 6}, ks[4] = {Ko, D, D, I};
  Projections proj;
  proj.int8_dot = packing_.int8_dot;
  for (int i = 0; i < 4; ++i) {
    if (packing_.bits)
      proj.q.push_back(qlinear_target(inputs[at[i]], inputs[7 + i], inputs[11 + i], ks[i], packing_.group_size,
                                      packing_.bits, encoder));
    else
      proj.f.push_back(linear_target(inputs[at[i]], b[i], ks[i], encoder));
  }
  const auto& nw = inputs[3];
  encoder.set_input_array(nw);
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_output_array(out);
  const float* hp = h.data<float>();
  const float* op = o.data<float>();
  const float* wn = nw.data<float>();
  const int64_t wns = nw.strides()[0];
  float* outp = out.data<float>();
  const float eps = eps_;
  encoder.dispatch([=]() {
    // Scratch kept by this thread (MLX's stream thread runs one op at a time): the layer's
    // intermediate activations, which as separate ops were an MLX buffer each.
    thread_local std::vector<float> buf;
    const int64_t md = (int64_t)M * D, mi = (int64_t)M * I;
    buf.resize((size_t)(3 * md + 3 * mi));
    float* y = buf.data();   // o_proj(o), then down_proj(...)
    float* h1 = y + md;      // the residual after the attention
    float* x = h1 + md;      // its norm
    float* gate = x + md;
    float* up = gate + mi;
    float* act = up + mi;    // swiglu(gate, up)
    proj.run({{0, y}}, op, M, Ko);
    add_run(hp, y, h1, md);
    rms_norm_rows_run(h1, wn, wns, x, M, D, eps);
    proj.run({{1, gate}, {2, up}}, x, M, D);
    swiglu_run(gate, up, act, mi);
    proj.run({{3, y}}, act, M, I);
    add_run(h1, y, outp, md);
  });
}

} // namespace mlxq
