// quantized_linear as one CPU primitive over the pool; see qlinear_ops.h.
#include "qlinear_ops.h"

#include <algorithm>
#include <string>
#include <stdexcept>
#include <vector>

#include "isa.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "linear_ops.h"
#include "qdot.h"
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

// int8_dot's loops: AVX-VNNI where the CPU has it, else AVX2 (each with F16C), else the generic ones (the
// same bits).
struct DotLoops {
  qdot::QuantizeFn quantize;
  qdot::DotFn fn;
  const char* name;
};

DotLoops pick_dot() {
#ifdef MLXQ_PA_HAVE_AVX2
  if (use_avx2_f16c()) {
    if (isa_request() != "avx2" && __builtin_cpu_supports("avxvnni"))
      return {&qdot::vnni::quantize_rows, &qdot::vnni::dot, "avx-vnni"};
    return {&qdot::avx2::quantize_rows, &qdot::avx2::dot, "avx2"};
  }
#endif
  return {&qdot::generic::quantize_rows, &qdot::generic::dot, "generic"};
}

const DotLoops g_dot = pick_dot();

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

const char* qdot_isa() {
  return g_dot.name;
}

const char* qlinear_isa() {
#ifdef MLXQ_PA_HAVE_AVX2
  if (g_loops.matvec == &qmatmul::avx2::matvec)
    return "avx2";
#endif
  return "generic";
}

void check_packed(const char* op, const mx::array& w, const mx::array& scales, const mx::array& biases, int K,
                  int group_size, int bits, bool int8_dot) {
  const std::string name(op);
  if (bits != 4 && bits != 8)
    throw std::invalid_argument(name + ": bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument(name + ": group_size must be 32, 64 or 128");
  if (K == 0 || K % group_size != 0)
    throw std::invalid_argument(name + ": K must be a positive multiple of group_size");
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || (int64_t)w.shape(1) * 32 != (int64_t)K * bits || w.shape(0) == 0)
    throw std::invalid_argument(name + ": a packed weight must be uint32 (N, K * bits / 32) for x (..., K)");
  for (const auto* a : {&scales, &biases})
    if (a->ndim() != 2 || a->shape(0) != w.shape(0) || a->shape(1) != K / group_size)
      throw std::invalid_argument(name + ": scales and biases must be (N, K / group_size)");
  // the dequantizing loops (qmatmul.h) read float32 alone; int8_dot's read 16-bit floats too (qdot.h)
  const bool half = scales.dtype() == mx::float16 || scales.dtype() == mx::bfloat16;
  if (scales.dtype() != biases.dtype() || !(scales.dtype() == mx::float32 || (half && int8_dot)))
    throw std::invalid_argument(name + (int8_dot ? ": scales and biases must be both float32, both float16 or both "
                                                   "bfloat16"
                                                 : ": scales and biases must be float32 (float16 and bfloat16 are for "
                                                   "int8_dot)"));
}

QTarget qlinear_target(const mx::array& w, const mx::array& scales, const mx::array& biases, int K, int group_size,
                       int bits, mx::cpu::CommandEncoder& encoder) {
  const mx::array wr = row_contiguous(w, encoder), sr = row_contiguous(scales, encoder),
                  br = row_contiguous(biases, encoder);
  for (const auto* a : {&wr, &sr, &br})
    encoder.set_input_array(*a);
  const qmatmul::ScaleKind kind = scales.dtype() == mx::float16    ? qmatmul::ScaleKind::f16
                                  : scales.dtype() == mx::bfloat16 ? qmatmul::ScaleKind::bf16
                                                                   : qmatmul::ScaleKind::f32;
  return {{wr.data<uint32_t>(), sr.data<void>(), br.data<void>(), K, bits, group_size, kind}, nullptr, w.shape(0)};
}

void quantized_linear_run(const std::vector<QTarget>& targets, const float* x, int M, int K, bool int8_dot) {
  // int8_dot: x's rows rounded to 8 bits once, for every part of every weight (one bits a call)
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xsum;
  if (int8_dot) {
    const int64_t blocks = (int64_t)M * qdot::padded_blocks(K);
    xq.resize((size_t)blocks * qdot::kBlock);
    xd.resize(blocks);
    xsum.resize(blocks);
    g_dot.quantize(x, M, K, targets[0].q.bits, xq.data(), xd.data(), xsum.data());
  }
  const qdot::QAct act{xq.data(), xd.data(), xsum.data(), K};
  // x packed once for linear's loops where they read a packing (many rows)
  thread_local std::vector<float> pairs;
  const float* xpairs = !int8_dot && M > kRegisterRows && rowdot_loops() != nullptr ? rowdot_pack(x, M, K, pairs) : nullptr;
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
    const QTarget& t = targets[parts[p].target];
    if (int8_dot)
      g_dot.fn(act, M, t.q, t.y, t.N, parts[p].c0, parts[p].c1);
    else
      run_part(t.q, x, xpairs, M, t.y, t.N, parts[p].c0, parts[p].c1);
  };
  tp.parallel_for((int)parts.size(), part); // one part: here, on this thread
}

std::vector<mx::array> quantized_linear_group(const mx::array& x, const std::vector<mx::array>& ws,
                                              const std::vector<mx::array>& scales,
                                              const std::vector<mx::array>& biases, int group_size, int bits,
                                              bool int8_dot) {
  if (x.dtype() != mx::float32 || x.ndim() < 1)
    throw std::invalid_argument("quantized_linear: x must be float32 (..., K)");
  if (ws.empty() || scales.size() != ws.size() || biases.size() != ws.size())
    throw std::invalid_argument("quantized_linear: one or more weights, each with its scales and biases");
  const int K = x.shape(-1);
  std::vector<mx::array> inputs = {x};
  std::vector<mx::Shape> shapes;
  for (size_t g = 0; g < ws.size(); ++g) {
    const auto& w = ws[g];
    check_packed("quantized_linear", w, scales[g], biases[g], K, group_size, bits, int8_dot);
    inputs.insert(inputs.end(), {w, scales[g], biases[g]});
    auto shape = x.shape();
    shape.back() = w.shape(0);
    shapes.push_back(shape);
  }
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  auto prim = std::make_shared<QuantizedLinear>(s, group_size, bits, (int)ws.size(), int8_dot);
  if (ws.size() == 1)
    return {mx::array(shapes[0], mx::float32, prim, std::move(inputs))};
  return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(ws.size(), mx::float32), prim,
                                std::move(inputs));
}

mx::array quantized_linear(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, bool int8_dot) {
  return quantized_linear_group(x, {w}, {scales}, {biases}, group_size, bits, int8_dot)[0];
}

void QuantizedLinear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const mx::array x = row_contiguous(inputs[0], encoder);
  encoder.set_input_array(x);
  const int K = x.shape(-1);
  const int M = (int)(x.size() / (size_t)K);
  std::vector<QTarget> targets;
  for (int g = 0; g < groups_; ++g) {
    auto& out = outputs[g];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
    targets.push_back(qlinear_target(inputs[1 + 3 * g], inputs[2 + 3 * g], inputs[3 + 3 * g], K, group_size_, bits_,
                                     encoder));
    targets.back().y = out.data<float>();
  }
  const float* xp = x.data<float>();
  const bool int8_dot = int8_dot_;
  encoder.dispatch([=]() { quantized_linear_run(targets, xp, M, K, int8_dot); });
}

bool QuantizedLinear::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedLinear&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && groups_ == o.groups_ && int8_dot_ == o.int8_dot_;
}

} // namespace mlxq
