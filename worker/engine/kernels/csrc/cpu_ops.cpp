// swiglu, rope and paged_kv_write as MLX CPU primitives (see cpu_ops.h).
//
// Compiled with -ffp-contract=off (CMakeLists.txt): every fused multiply-add
// below is an explicit fma, exactly where MLX's own code has one, so the
// compiler may not fuse anything else and the results stay bit-identical to
// MLX's.
#include "cpu_ops.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>
#include <algorithm>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLXQ_X86 1
#endif

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/simd/math.h"
#include "mlx/backend/cpu/unary_ops.h"
#include "isa.h"
#include "row_contiguous.h"
#include "thread_pool.h"

namespace mlxq {
namespace {

// ------------------------------------------------------------------ swiglu
// The scalar path is MLX's own code (its shipped headers: detail::Sigmoid and
// simd::exp at width 1, which is what the x86-64 wheel runs), then nn.silu's
// x * sigmoid(x) and swiglu's silu(gate) * up.
inline float mlx_exp(float x) {
  return mx::simd::exp(mx::simd::Simd<float, 1>(x)).value;
}

inline float swiglu_one(float g, float u) {
  return (g * mx::detail::Sigmoid{}(g)) * u;
}

void swiglu_generic(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = swiglu_one(g[i], u[i]);
}

#ifdef MLXQ_X86
// The same exp and sigmoid 8 floats at a time: MLX's steps one for one (its Simd
// has width 1 off Apple, so there is no MLX code to reuse here).
__attribute__((target("avx2,fma"))) inline __m256 floor_plus_half(__m256 x) {
  // floor(x + 0.5) with the add in double, as MLX does: exact for every float.
  const __m256d half = _mm256_set1_pd(0.5);
  __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  lo = _mm256_floor_pd(_mm256_add_pd(lo, half));
  hi = _mm256_floor_pd(_mm256_add_pd(hi, half));
  return _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
}

__attribute__((target("avx2,fma"))) inline __m256 mlx_exp8(__m256 x_init) {
  __m256 x = _mm256_mul_ps(x_init, _mm256_set1_ps(1.442695f));
  const __m256 ipart = floor_plus_half(x);
  const __m256 fpart = _mm256_sub_ps(x, ipart);
  x = _mm256_set1_ps(1.535336188319500e-4f);
  x = _mm256_fmadd_ps(x, fpart, _mm256_set1_ps(1.339887440266574e-3f));
  x = _mm256_fmadd_ps(x, fpart, _mm256_set1_ps(9.618437357674640e-3f));
  x = _mm256_fmadd_ps(x, fpart, _mm256_set1_ps(5.550332471162809e-2f));
  x = _mm256_fmadd_ps(x, fpart, _mm256_set1_ps(2.402264791363012e-1f));
  x = _mm256_fmadd_ps(x, fpart, _mm256_set1_ps(6.931472028550421e-1f));
  x = _mm256_fmadd_ps(x, fpart, _mm256_set1_ps(1.000000000000000f));
  // ipart is in [-127, 128] wherever the result is not overridden below.
  const __m256 clamped = _mm256_min_ps(_mm256_max_ps(ipart, _mm256_set1_ps(-127.0f)),
                                       _mm256_set1_ps(128.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(clamped), _mm256_set1_epi32(127)), 23);
  __m256 r = _mm256_mul_ps(_mm256_castsi256_ps(e), x);
  const __m256 nan = _mm256_cmp_ps(x_init, x_init, _CMP_UNORD_Q);
  r = _mm256_blendv_ps(r, x_init, nan);
  r = _mm256_blendv_ps(r, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                       _mm256_cmp_ps(x_init, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  r = _mm256_blendv_ps(r, _mm256_setzero_ps(),
                       _mm256_cmp_ps(x_init, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
  return r;
}

__attribute__((target("avx2,fma"))) void swiglu_avx2(
    const float* g,
    const float* u,
    float* out,
    int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, mlx_exp8(_mm256_and_ps(gv, abs_mask))));
    const __m256 neg = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 s = _mm256_blendv_ps(_mm256_sub_ps(one, y), y, neg);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, s), _mm256_loadu_ps(u + i)));
  }
  swiglu_generic(g + i, u + i, out + i, n - i);
}
#endif

using SwigluFn = void (*)(const float*, const float*, float*, int64_t);

SwigluFn pick_swiglu() {
#ifdef MLXQ_X86
  if (use_avx2_fma())
    return swiglu_avx2;
#endif
  return swiglu_generic;
}

const SwigluFn g_swiglu = pick_swiglu();

std::atomic<int64_t> g_kv_write_copies{0};

mx::Stream cpu_stream() {
  return mx::default_stream(mx::Device(mx::Device::cpu));
}

std::atomic<int64_t> g_kv_write_waits{0};

// MLX donates an input's buffer to an output only when nothing else holds it
// (array::is_donatable), and its CPU backend holds each input of an encoded op
// until that op's task has run. While the engine encodes step t+1 (mx.async_eval
// pipelining), step t's attention may still be queued, so the pool looks shared
// although its only other reader runs before this write on the same in-order
// stream. Rather than copy the pool, wait (here, at encode time) for the stream
// to run what is queued so far, and ask again: the stream keeps computing while
// we wait. Still shared then means a real holder (a view, an array the caller
// kept), and the pool is copied. Each wait is counted (kv_write_waits).
bool writable_in_place(const mx::array& pool, const mx::Stream& s) {
  if (pool.is_donatable())
    return true;
  mx::synchronize(s);
  if (!pool.is_donatable())
    return false;
  g_kv_write_waits.fetch_add(1);
  return true;
}

// ------------------------------------------------------------------ rope's cos/sin
// mlx/fast.cpp's fallback, step by step, each op rounded to float32 as there:
// inv_freqs = exp(arange(0, -half, -1) * (log(base) / half)); positions = (arange(T) +
// offset) * scale; theta = positions * inv_freqs; then MLX's own cos and sin of theta.
inline float rope_position(int32_t offset, int t, float scale) {
  return (static_cast<float>(t) + static_cast<float>(offset)) * scale;
}

// A position's cos/sin depend on nothing but the position and (half, base, scale), and a
// decode step asks for the same ones in every layer, twice (queries and keys): each
// position's row is computed once, when first asked for, and kept (the same operations, so
// the same bits). Positions [0, kMaxPos) are kept: half * 8 bytes each; others are computed
// at each call. One table per thread (the ops run on MLX's CPU stream thread).
class RopeTable {
 public:
  static constexpr int kMaxPos = 1 << 16;

  RopeTable(int half, float base, float scale) : half_(half), base_(base), scale_(scale), inv_freq_(half) {
    const float c = std::log(base) / half;
    for (int i = 0; i < half; ++i)
      inv_freq_[i] = mlx_exp(static_cast<float>(-i) * c);
  }
  bool is(int half, float base, float scale) const {
    return half == half_ && base == base_ && scale == scale_;
  }
  void compute(float pos, float* cs, float* sn) const {
    namespace simd = mx::simd;
    using F1 = simd::Simd<float, 1>;
    for (int i = 0; i < half_; ++i) {
      const F1 theta{pos * inv_freq_[i]};
      cs[i] = simd::cos(theta).value;
      sn[i] = simd::sin(theta).value;
    }
  }
  // The row of offset + t, if it is one the table keeps (then float(t) + float(offset) is
  // float(t + offset) exactly: integers below 2^24).
  bool lookup(int32_t offset, int t, const float*& cs, const float*& sn) {
    if (offset < 0 || offset >= kMaxPos || t >= kMaxPos - offset)
      return false;
    const int p = offset + t;
    if (p >= n_) {
      const int n = std::min(kMaxPos, std::max(p + 1, 2 * n_));
      cs_.resize((size_t)n * half_);
      sn_.resize((size_t)n * half_);
      for (int q = n_; q < n; ++q)
        compute(rope_position(q, 0, scale_), &cs_[(size_t)q * half_], &sn_[(size_t)q * half_]);
      n_ = n;
    }
    cs = &cs_[(size_t)p * half_];
    sn = &sn_[(size_t)p * half_];
    return true;
  }

 private:
  int half_;
  float base_, scale_;
  std::vector<float> inv_freq_, cs_, sn_;
  int n_ = 0;
};

RopeTable& rope_table(int half, float base, float scale) {
  thread_local std::vector<std::unique_ptr<RopeTable>> tables; // a model has one; kept few
  for (auto& tb : tables)
    if (tb->is(half, base, scale))
      return *tb;
  if (tables.size() >= 4)
    tables.erase(tables.begin());
  tables.push_back(std::make_unique<RopeTable>(half, base, scale));
  return *tables.back();
}

} // namespace

int64_t kv_write_copies() {
  return g_kv_write_copies.load();
}

int64_t kv_write_waits() {
  return g_kv_write_waits.load();
}

const char* swiglu_isa() {
  return g_swiglu == swiglu_generic ? "generic" : "avx2";
}

// ------------------------------------------------------------------ ops
mx::array swiglu(const mx::array& gate, const mx::array& up) {
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32)
    throw std::invalid_argument("swiglu: float32 only");
  if (gate.shape() != up.shape())
    throw std::invalid_argument("swiglu: gate and up must have one shape");
  auto s = cpu_stream();
  return mx::array(
      gate.shape(),
      mx::float32,
      std::make_shared<SwiGLU>(s),
      {gate, up});
}

mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset) {
  if (x.dtype() != mx::float32)
    throw std::invalid_argument("rope: float32 only");
  if (x.ndim() != 4)
    throw std::invalid_argument("rope: x must be (B, H, T, D)");
  auto s = cpu_stream();
  return mx::array(
      x.shape(),
      mx::float32,
      std::make_shared<RoPE>(s, dims, traditional, base, scale),
      {x, rope_offsets("rope", dims, x.shape(3), offset, x.shape(0))});
}

mx::array rope_offsets(const char* op, int dims, int head_dim, const mx::array& offsets, int rows) {
  const std::string who(op);
  if (dims <= 0 || dims % 2 != 0 || dims > head_dim)
    throw std::invalid_argument(who + ": rope dims must be even, positive and at most the head dim");
  if (offsets.size() != 1 && offsets.size() != (size_t)rows)
    throw std::invalid_argument(who + ": offsets must be a scalar or one per row");
  if (!mx::issubdtype(offsets.dtype(), mx::integer))
    throw std::invalid_argument(who + ": offsets must be an integer");
  auto s = cpu_stream();
  return mx::astype(mx::reshape(offsets, {-1}, s), mx::int32, s);
}

std::vector<mx::array> paged_kv_write(
    const mx::array& k_pool,
    const mx::array& v_pool,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& slots) {
  auto fail = [](const std::string& msg) {
    throw std::invalid_argument("paged_kv_write: " + msg);
  };
  if (k_pool.ndim() != 3 || v_pool.ndim() != 3)
    fail("the pools must be (H, S, D)");
  if (keys.ndim() != 4 || values.ndim() != 4)
    fail("keys and values must be (B, H, N, D)");
  const int H = k_pool.shape(0), S = k_pool.shape(1);
  if (v_pool.shape(0) != H || v_pool.shape(1) != S)
    fail("k_pool and v_pool disagree on heads or slots");
  if (keys.shape(1) != H || values.shape(1) != H)
    fail("keys/values and the pools disagree on heads");
  if (keys.shape(0) != values.shape(0) || keys.shape(2) != values.shape(2))
    fail("keys and values disagree on rows or tokens");
  if (keys.shape(3) != k_pool.shape(2) || values.shape(3) != v_pool.shape(2))
    fail("keys/values and the pools disagree on the head dim");
  if (keys.dtype() != k_pool.dtype() || values.dtype() != v_pool.dtype())
    fail("keys/values must have the pools' dtype");
  if (slots.ndim() != 1 || slots.shape(0) != keys.shape(0) * keys.shape(2))
    fail("slots must be (B * N,)");
  auto s = cpu_stream();
  auto slots32 = mx::astype(slots, mx::int32, s);
  // One single-output node per pool: a multi-output node keeps a copy of its
  // inputs per output, and a pool referenced twice cannot be donated. The pool
  // goes in as it is (a contiguous() node would share its buffer, which stops
  // the donation too); the engine's pools are row-contiguous by construction.
  auto write = [&](const mx::array& pool, const mx::array& rows) {
    return mx::array(
        pool.shape(),
        pool.dtype(),
        std::make_shared<PagedKVWrite>(s),
        {pool, rows, slots32}); // rows and slots: made row-contiguous in eval_cpu
  };
  return {write(k_pool, keys), write(v_pool, values)};
}

// ------------------------------------------------------------------ eval
void SwiGLU::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const auto g = row_contiguous(inputs[0], encoder);
  const auto u = row_contiguous(inputs[1], encoder);
  encoder.set_input_array(g);
  encoder.set_input_array(u);
  encoder.set_output_array(out);
  const float* gp = g.data<float>();
  const float* up = u.data<float>();
  float* op = out.data<float>();
  const int64_t n = out.size();
  encoder.dispatch([gp, up, op, n]() { swiglu_run(gp, up, op, n); });
}

void swiglu_run(const float* gp, const float* up, float* op, int64_t n) {
  // Large ones (an MLP's activations at batch 64: 76k floats, ~80 us) on the pool's threads,
  // in parts of whole 8-float vectors; each float's value is its own.
  split_ranges(pool(), n, n, 8, [&](int64_t i0, int64_t i1) { g_swiglu(gp + i0, up + i0, op + i0, i1 - i0); });
}

std::vector<mx::array> SwiGLU::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  const auto& g = primals[0];
  const auto& u = primals[1];
  const auto& c = cotangents[0];
  auto s = mx::sigmoid(g, stream());
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg == 0) {
      // d/dg [g * s(g)] = s + g * s * (1 - s)
      auto dsilu = mx::add(s, mx::multiply(mx::multiply(g, s, stream()),
                                           mx::subtract(mx::array(1.0f), s, stream()), stream()),
                           stream());
      grads.push_back(mx::multiply(c, mx::multiply(u, dsilu, stream()), stream()));
    } else {
      grads.push_back(mx::multiply(c, mx::multiply(g, s, stream()), stream()));
    }
  }
  return grads;
}

void RoPE::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  // x read where it lies when its rows (D) are contiguous: the model's queries and keys come as
  // (B, H, T, D) views of the projections (a transpose), which a row-contiguous copy would first
  // rewrite.
  const auto x = inputs[0].strides()[3] == 1 ? inputs[0] : row_contiguous(inputs[0], encoder);
  const auto off = row_contiguous(inputs[1], encoder);
  for (const auto& a : inputs)
    encoder.set_input_array(a);
  encoder.set_output_array(out);
  const float* xp = x.data<float>();
  const int32_t* op = off.data<int32_t>();
  float* yp = out.data<float>();
  const int B = x.shape(0), H = x.shape(1), T = x.shape(2), D = x.shape(3);
  const int64_t sb = x.strides()[0], sh = x.strides()[1], st = x.strides()[2];
  const int n_off = off.size();
  const int dims = dims_;
  const bool traditional = traditional_;
  const float base = base_, scale = scale_;
  encoder.dispatch([=]() { rope_run(xp, sb, sh, st, B, H, T, D, op, n_off, dims, traditional, base, scale, yp); });
}

void rope_run(const float* xp, int64_t sb, int64_t sh, int64_t st, int B, int H, int T, int D,
              const int32_t* op, int n_off, int dims, bool traditional, float base, float scale, float* yp) {
  const int half = dims / 2;
  // Positions (b, t) in [r0, r1), every head of each; a float's value is its own, whichever
  // thread computes it (each thread's table holds the same values: RopeTable::compute).
  auto rows = [&](int64_t r0, int64_t r1) {
    RopeTable& table = rope_table(half, base, scale);
    thread_local std::vector<float> cs_own, sn_own;
    for (int64_t r = r0; r < r1; ++r) {
      const int b = (int)(r / T), t = (int)(r % T);
      const int32_t o = op[n_off == 1 ? 0 : b];
      const float* cs;
      const float* sn;
      if (!table.lookup(o, t, cs, sn)) { // outside the table: computed here, the same way
        cs_own.resize(half);
        sn_own.resize(half);
        table.compute(rope_position(o, t, scale), cs_own.data(), sn_own.data());
        cs = cs_own.data();
        sn = sn_own.data();
      }
      for (int h = 0; h < H; ++h) {
        const float* xr = xp + b * sb + h * sh + t * st;
        float* yr = yp + (((int64_t)b * H + h) * T + t) * D;
        for (int i = 0; i < half; ++i) {
          const int i1 = traditional ? 2 * i : i;
          const int i2 = traditional ? 2 * i + 1 : i + half;
          const float x1 = xr[i1], x2 = xr[i2];
          yr[i1] = x1 * cs[i] - x2 * sn[i];
          yr[i2] = x1 * sn[i] + x2 * cs[i];
        }
        for (int d = dims; d < D; ++d)
          yr[d] = xr[d];
      }
    }
  };
  // Large calls (a batch-64 decode step's queries: 32k floats) on the pool's threads.
  split_ranges(pool(), (int64_t)B * T, (int64_t)B * H * T * D, 1, rows);
}

bool RoPE::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RoPE&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ &&
      scale_ == o.scale_;
}

void PagedKVWrite::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const auto& pool = inputs[0];
  const auto rows = row_contiguous(inputs[1], encoder);
  const auto slots = row_contiguous(inputs[2], encoder);
  auto& out = outputs[0];
  if (!pool.flags().row_contiguous)
    throw std::runtime_error("paged_kv_write: the KV pools must be row-contiguous");
  const uint8_t* copy_from = nullptr;
  if (writable_in_place(pool, stream())) {
    out.copy_shared_buffer(pool); // in place
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    copy_from = pool.data<uint8_t>();
    g_kv_write_copies.fetch_add(1);
  }
  for (const auto& x : inputs)
    encoder.set_input_array(x);
  encoder.set_output_array(out);
  const int B = rows.shape(0), H = rows.shape(1), N = rows.shape(2);
  const int64_t S = pool.shape(1);
  const size_t row_bytes = (size_t)rows.shape(3) * rows.itemsize(); // one token, one head
  const size_t pool_bytes = out.nbytes();
  uint8_t* dst = out.data<uint8_t>();
  const uint8_t* src = rows.data<uint8_t>();
  const int32_t* sl = slots.data<int32_t>();
  encoder.dispatch([=]() {
    if (copy_from != nullptr)
      std::memcpy(dst, copy_from, pool_bytes);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int n = 0; n < N; ++n) {
          const int64_t slot = sl[(int64_t)b * N + n];
          if (slot < 0 || slot >= S)
            continue; // never out of bounds (the engine never asks for it)
          std::memcpy(
              dst + ((int64_t)h * S + slot) * row_bytes,
              src + (((int64_t)b * H + h) * N + n) * row_bytes,
              row_bytes);
        }
  });
}

} // namespace mlxq
