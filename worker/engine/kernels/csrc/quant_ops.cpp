// kv_quantize as one CPU primitive; see quant_ops.h.
#include "quant_ops.h"

#include <cmath>
#include <cstdint>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "row_contiguous.h"

namespace mlxq {

std::vector<mx::array> kv_quantize(
    const mx::array& x,
    const mx::array& xq,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    int rounds) {
  if (bits != 4 && bits != 8)
    throw std::invalid_argument("kv_quantize: bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("kv_quantize: group_size must be 32, 64 or 128");
  if (rounds < 0 || rounds > 8)
    throw std::invalid_argument("kv_quantize: rounds must be 0 to 8");
  if (x.dtype() != mx::float32 || scales.dtype() != mx::float32 || biases.dtype() != mx::float32 ||
      xq.dtype() != mx::uint32)
    throw std::invalid_argument("kv_quantize: x, scales and biases float32, xq uint32");
  const int D = x.ndim() ? x.shape(-1) : 0;
  if (x.ndim() < 1 || D % group_size)
    throw std::invalid_argument("kv_quantize: x's last dimension must be a multiple of group_size");
  auto lead = x.shape();
  lead.pop_back();
  auto with_last = [&](int n) {
    auto s = lead;
    s.push_back(n);
    return s;
  };
  if (xq.shape() != with_last(D * bits / 32) || scales.shape() != with_last(D / group_size) ||
      biases.shape() != with_last(D / group_size))
    throw std::invalid_argument("kv_quantize: xq, scales and biases must be mx.quantize's outputs for x");
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  return mx::array::make_arrays(
      {xq.shape(), scales.shape(), biases.shape()}, {mx::uint32, mx::float32, mx::float32},
      std::make_shared<KVQuantizeOp>(s, group_size, bits, rounds), {x, xq, scales, biases});
}

namespace {

constexpr int kMaxGroup = 128;
// Groups side by side: each group's sums are its own chains of adds, one float at a time, so
// its bits do not depend on its neighbours; NG chains interleaved keep the adder busy where one
// waits on each add's latency.
constexpr int kGroups = 8;

// Groups [0, NG) of a run of consecutive groups: x (NG * g floats), their packed integers qw
// (g * bits / 32 words each), mx.quantize's scales and biases, into oq, os, ob.
template <int NG>
void quantize_groups(const float* x, const uint32_t* qw, const float* s0, const float* b0, uint32_t* oq, float* os,
                     float* ob, int g, int bits, int rounds) {
  const uint32_t mask = (1u << bits) - 1;
  const float top = (float)mask, inv_g = static_cast<float>(1.0 / (double)g);
  const int words = g * bits / 32, per = 32 / bits;
  float q[NG][kMaxGroup];
  float mean_x[NG], scale[NG], bias[NG];
  for (int i = 0; i < NG; ++i) {
    for (int j = 0; j < g; ++j) {
      const int bit = j * bits;
      q[i][j] = (float)((qw[i * words + bit / 32] >> (bit % 32)) & mask);
    }
    scale[i] = s0[i];
    bias[i] = b0[i];
  }
  {
    float sx[NG];
    for (int i = 0; i < NG; ++i)
      sx[i] = 0.0f;
    for (int j = 0; j < g; ++j)
      for (int i = 0; i < NG; ++i)
        sx[i] = sx[i] + x[i * g + j];
    for (int i = 0; i < NG; ++i)
      mean_x[i] = sx[i] * inv_g;
  }
  for (int t = 0; t <= rounds; ++t) {
    // the least-squares line through (q_j, x_j), as the MLX ops compute it: the scale kept where
    // the integers do not spread (var 0) or do not follow x (cov 0)
    float sq[NG], var[NG], cov[NG], mean_q[NG];
    for (int i = 0; i < NG; ++i)
      sq[i] = var[i] = cov[i] = 0.0f;
    for (int j = 0; j < g; ++j)
      for (int i = 0; i < NG; ++i)
        sq[i] = sq[i] + q[i][j];
    for (int i = 0; i < NG; ++i)
      mean_q[i] = sq[i] * inv_g;
    for (int j = 0; j < g; ++j)
      for (int i = 0; i < NG; ++i) {
        const float dq = q[i][j] - mean_q[i];
        const float dd = dq * dq;
        const float dx = dq * x[i * g + j];
        var[i] = var[i] + dd;
        cov[i] = cov[i] + dx;
      }
    for (int i = 0; i < NG; ++i) {
      if (var[i] > 0.0f && cov[i] != 0.0f)
        scale[i] = cov[i] / var[i];
      const float sm = scale[i] * mean_q[i];
      bias[i] = mean_x[i] - sm;
    }
    if (t == rounds)
      break;
    // each value to its nearest integer of the line: mx.clip(mx.round(v), 0, top) is
    // round(clip(v, 0, top)) (rounding is monotone, the ends are integers), and below 2^23
    // (v + 2^23) - 2^23 is v rounded half to even, as mx.round
    for (int i = 0; i < NG; ++i)
      for (int j = 0; j < g; ++j) {
        const float d = x[i * g + j] - bias[i];
        float v = d / scale[i];
        v = v > 0.0f ? v : 0.0f;
        v = v < top ? v : top;
        const float r = v + 8388608.0f;
        q[i][j] = r - 8388608.0f;
      }
  }
  for (int i = 0; i < NG; ++i) {
    os[i] = scale[i];
    ob[i] = bias[i];
    for (int w = 0; w < words; ++w) {
      uint32_t word = 0;
      for (int j = 0; j < per; ++j)
        word |= (uint32_t)q[i][w * per + j] << (j * bits);
      oq[i * words + w] = word;
    }
  }
}

} // namespace

void KVQuantizeOp::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const mx::array x = row_contiguous(inputs[0], encoder);
  const mx::array xq = row_contiguous(inputs[1], encoder);
  const mx::array sc = row_contiguous(inputs[2], encoder);
  const mx::array bi = row_contiguous(inputs[3], encoder);
  for (auto& o : outputs)
    o.set_data(mx::allocator::malloc(o.nbytes()));
  for (const auto& a : {x, xq, sc, bi})
    encoder.set_input_array(a);
  for (auto& o : outputs)
    encoder.set_output_array(o);
  const int g = group_size_, bits = bits_, rounds = rounds_;
  const int64_t n = (int64_t)x.size() / g, words = g * bits / 32; // groups, and words a group
  const float* xp = x.data<float>();
  const uint32_t* qp = xq.data<uint32_t>();
  const float* sp = sc.data<float>();
  const float* bp = bi.data<float>();
  uint32_t* oq = outputs[0].data<uint32_t>();
  float* os = outputs[1].data<float>();
  float* ob = outputs[2].data<float>();
  encoder.dispatch([=]() {
    // row-contiguous x (..., D), D a multiple of g: group t is x[t * g, (t + 1) * g), its words
    // and its scale likewise at t
    int64_t t = 0;
    for (; t + kGroups <= n; t += kGroups)
      quantize_groups<kGroups>(xp + t * g, qp + t * words, sp + t, bp + t, oq + t * words, os + t, ob + t, g,
                               bits, rounds);
    for (; t < n; ++t)
      quantize_groups<1>(xp + t * g, qp + t * words, sp + t, bp + t, oq + t * words, os + t, ob + t, g, bits,
                         rounds);
  });
}

} // namespace mlxq
