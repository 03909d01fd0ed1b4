// quantized_linear as one CPU primitive over the pool; see qlinear_ops.h.
#include "qlinear_ops.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "isa.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "linear_ops.h"
#include "qmatmul.h"
#include "row_contiguous.h"
#include "thread_pool.h"

namespace mlxq {

namespace {

struct Loops {
  qmatmul::MatvecFn matvec;
  qmatmul::DequantFn dequantize;
};

Loops pick() {
#ifdef MLXQ_PA_HAVE_AVX2
  if (use_avx2_fma())
    return {&qmatmul::avx2::matvec, &qmatmul::avx2::dequantize_rows};
#endif
  return {&qmatmul::generic::matvec, &qmatmul::generic::dequantize_rows};
}

const Loops g_loops = pick();

// Output columns per part: parts of 16 columns and more, 4 per pool thread (claimed by whichever
// thread is free, as linear's).
constexpr int kColAlign = 16, kPartsPerThread = 4;

// Rows of x up to which the weights are dequantized in registers; past it a strip of weight rows
// is dequantized into a buffer (16 K floats, in cache beside x's rows) and linear's own loops,
// with their tiles for several rows, multiply by it. The 7 matrices of SmolLM2-135M's 30 layers,
// 4-bit, one process alternating, 2 loaded cores, 2026-12-01: one row in registers 16-20 ms
// against 44-155 through the buffer (fp32 copy: 33-61); at 2 to 4 rows the buffer 27-33 ms
// against 39-65 in register tiles of 2 rows (fp32: 35-72); 64 rows 107 against 179 (fp32).
constexpr int kRegisterRows = 1;
constexpr int64_t kStripFloats = 1 << 14;

// Columns [c0, c1) of y (M rows of N).
void run_part(const qmatmul::QWeight& q, const float* x, const float* xpairs, int M, float* y, int N, int c0,
              int c1) {
  const rowdot::MatmulFn loops = rowdot_loops();
  if (M <= kRegisterRows || loops == nullptr) {
    g_loops.matvec(x, M, q, y, N, c0, c1);
    return;
  }
  const int K = q.K;
  const int rows = (int)std::max<int64_t>(8, kStripFloats / K);
  thread_local std::vector<float> strip;
  strip.resize((size_t)rows * K);
  for (int n = c0; n < c1; n += rows) {
    const int ne = std::min(c1, n + rows);
    g_loops.dequantize(q, n, ne, strip.data());
    loops(x, K, M, strip.data(), K, y + n, N, K, 0, ne - n, false, xpairs);
  }
}

} // namespace

const char* qlinear_isa() {
#ifdef MLXQ_PA_HAVE_AVX2
  if (g_loops.matvec == &qmatmul::avx2::matvec)
    return "avx2";
#endif
  return "generic";
}

std::vector<mx::array> quantized_linear_group(const mx::array& x, const std::vector<mx::array>& ws,
                                              const std::vector<mx::array>& scales,
                                              const std::vector<mx::array>& biases, int group_size, int bits) {
  if (bits != 4 && bits != 8)
    throw std::invalid_argument("quantized_linear: bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("quantized_linear: group_size must be 32, 64 or 128");
  if (x.dtype() != mx::float32 || x.ndim() < 1)
    throw std::invalid_argument("quantized_linear: x must be float32 (..., K)");
  if (ws.empty() || scales.size() != ws.size() || biases.size() != ws.size())
    throw std::invalid_argument("quantized_linear: one or more weights, each with its scales and biases");
  const int K = x.shape(-1);
  if (K == 0 || K % group_size != 0)
    throw std::invalid_argument("quantized_linear: K must be a positive multiple of group_size");
  std::vector<mx::array> inputs = {x};
  std::vector<mx::Shape> shapes;
  for (size_t g = 0; g < ws.size(); ++g) {
    const auto& w = ws[g];
    if (w.dtype() != mx::uint32 || w.ndim() != 2 || (int64_t)w.shape(1) * 32 != (int64_t)K * bits || w.shape(0) == 0)
      throw std::invalid_argument("quantized_linear: w must be uint32 (N, K * bits / 32) for x (..., K)");
    for (const auto* a : {&scales[g], &biases[g]})
      if (a->dtype() != mx::float32 || a->ndim() != 2 || a->shape(0) != w.shape(0) || a->shape(1) != K / group_size)
        throw std::invalid_argument("quantized_linear: scales and biases must be float32 (N, K / group_size)");
    inputs.insert(inputs.end(), {w, scales[g], biases[g]});
    auto shape = x.shape();
    shape.back() = w.shape(0);
    shapes.push_back(shape);
  }
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  auto prim = std::make_shared<QuantizedLinear>(s, group_size, bits, (int)ws.size());
  if (ws.size() == 1)
    return {mx::array(shapes[0], mx::float32, prim, std::move(inputs))};
  return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(ws.size(), mx::float32), prim,
                                std::move(inputs));
}

mx::array quantized_linear(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits) {
  return quantized_linear_group(x, {w}, {scales}, {biases}, group_size, bits)[0];
}

void QuantizedLinear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  std::vector<mx::array> in;
  for (const auto& a : inputs) {
    in.push_back(row_contiguous(a, encoder));
    encoder.set_input_array(in.back());
  }
  const int K = in[0].shape(-1);
  const int M = (int)(in[0].size() / (size_t)K);
  const float* x = in[0].data<float>();
  struct Target {
    qmatmul::QWeight q;
    float* y;
    int N;
  };
  std::vector<Target> targets;
  for (int g = 0; g < groups_; ++g) {
    auto& out = outputs[g];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
    const auto& w = in[1 + 3 * g];
    targets.push_back({{w.data<uint32_t>(), in[2 + 3 * g].data<float>(), in[3 + 3 * g].data<float>(), K, bits_,
                        group_size_},
                       out.data<float>(), w.shape(0)});
  }
  encoder.dispatch([=]() {
    // x packed once for linear's loops where they read a packing (many rows)
    thread_local std::vector<float> pairs;
    const float* xpairs = M > kRegisterRows && rowdot_loops() != nullptr ? rowdot_pack(x, M, K, pairs) : nullptr;
    ThreadPool& tp = pool();
    // each weight split as it is alone (the same parts: a part's bits do not depend on it anyway), every
    // part of every weight in one pass of the pool
    struct Part {
      int target, c0, c1;
    };
    std::vector<Part> parts;
    for (int t = 0; t < (int)targets.size(); ++t) {
      const int N = targets[t].N;
      const int n = std::max(1, std::min(tp.size() * kPartsPerThread, (N + kColAlign - 1) / kColAlign));
      const int per = ((N + n - 1) / n + kColAlign - 1) / kColAlign * kColAlign;
      for (int c0 = 0; c0 < N; c0 += per)
        parts.push_back({t, c0, std::min(N, c0 + per)});
    }
    auto part = [&](int p) {
      const Target& t = targets[parts[p].target];
      run_part(t.q, x, xpairs, M, t.y, t.N, parts[p].c0, parts[p].c1);
    };
    if (parts.size() == 1)
      part(0);
    else
      tp.parallel_for((int)parts.size(), part);
  });
}

bool QuantizedLinear::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedLinear&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && groups_ == o.groups_;
}

} // namespace mlxq
