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

mx::array quantized_linear(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits) {
  if (bits != 4 && bits != 8)
    throw std::invalid_argument("quantized_linear: bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("quantized_linear: group_size must be 32, 64 or 128");
  if (x.dtype() != mx::float32 || x.ndim() < 1)
    throw std::invalid_argument("quantized_linear: x must be float32 (..., K)");
  const int K = x.shape(-1);
  if (K == 0 || K % group_size != 0)
    throw std::invalid_argument("quantized_linear: K must be a positive multiple of group_size");
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || (int64_t)w.shape(1) * 32 != (int64_t)K * bits || w.shape(0) == 0)
    throw std::invalid_argument("quantized_linear: w must be uint32 (N, K * bits / 32) for x (..., K)");
  for (const auto* a : {&scales, &biases})
    if (a->dtype() != mx::float32 || a->ndim() != 2 || a->shape(0) != w.shape(0) || a->shape(1) != K / group_size)
      throw std::invalid_argument("quantized_linear: scales and biases must be float32 (N, K / group_size)");
  auto shape = x.shape();
  shape.back() = w.shape(0);
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  return mx::array(shape, mx::float32, std::make_shared<QuantizedLinear>(s, group_size, bits),
                   {x, w, scales, biases});
}

void QuantizedLinear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  std::vector<mx::array> in;
  for (const auto& a : inputs) {
    in.push_back(row_contiguous(a, encoder));
    encoder.set_input_array(in.back());
  }
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_output_array(out);
  const int K = in[0].shape(-1), N = in[1].shape(0);
  const int M = (int)(in[0].size() / (size_t)K);
  const float* x = in[0].data<float>();
  const uint32_t* w = in[1].data<uint32_t>();
  const float* sc = in[2].data<float>();
  const float* bi = in[3].data<float>();
  float* y = out.data<float>();
  const int gs = group_size_, bits = bits_;
  encoder.dispatch([=]() {
    const qmatmul::QWeight q{w, sc, bi, K, bits, gs};
    // x packed once for linear's loops where they read a packing (many rows)
    thread_local std::vector<float> pairs;
    const float* xpairs = M > kRegisterRows && rowdot_loops() != nullptr ? rowdot_pack(x, M, K, pairs) : nullptr;
    ThreadPool& tp = pool();
    const int n = std::max(1, std::min(tp.size() * kPartsPerThread, (N + kColAlign - 1) / kColAlign));
    const int per = ((N + n - 1) / n + kColAlign - 1) / kColAlign * kColAlign;
    const int parts = (N + per - 1) / per;
    auto part = [&](int p) { run_part(q, x, xpairs, M, y, N, p * per, std::min(N, (p + 1) * per)); };
    if (parts == 1)
      part(0);
    else
      tp.parallel_for(parts, part);
  });
}

bool QuantizedLinear::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedLinear&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

} // namespace mlxq
