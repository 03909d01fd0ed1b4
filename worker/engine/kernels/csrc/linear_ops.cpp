// linear as one CPU primitive over the pool and the BLAS; see linear_ops.h.
#include "linear_ops.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "isa.h"
#include "row_contiguous.h"
#include "rowdot.h"
#include "thread_pool.h"

namespace mlxq {

namespace {

// cblas_sgemm(order, transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                         float*, int);
// cblas_sgemv(order, trans, M, N, alpha, A, lda, x, incx, beta, y, incy)
using SgemvFn = void (*)(int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
using SetThreadsFn = void (*)(int);
using GetThreadsFn = int (*)();
constexpr int kRowMajor = 101, kColMajor = 102, kNoTrans = 111, kTrans = 112;

struct Blas {
  SgemmFn sgemm = nullptr;
  SgemvFn sgemv = nullptr;
  SetThreadsFn set_threads = nullptr;
  GetThreadsFn get_threads = nullptr;
};

std::atomic<const Blas*> g_blas{nullptr};

// Output columns per part: a multiple of 16 (the sgemm kernels' widest column block).
constexpr int kColAlign = 16;

// Parts per pool thread (for one row, and for any batch on our own loops, whose bits do
// not depend on the split). A part is claimed by whichever thread is free, so with several
// per thread a worker that wakes late still takes its share (with one each, the calling
// thread ran both halves while the worker woke: ~13% of a solo decode step on the bench
// model). The BLAS's sgemm keeps one part per thread.
constexpr int kPartsPerThread = 4;

// rowdot_impl.h's loops where the CPU has AVX2 and FMA (with AVX-512VL's registers where
// it has those too), else nullptr: the BLAS's sgemv and sgemm.
rowdot::MatmulFn pick_rowdot() {
#ifdef MLXQ_PA_HAVE_AVX2
  if (use_avx512vl())
    return &rowdot::avx512::matmul;
  if (use_avx2_fma())
    return &rowdot::avx2::matmul;
#endif
  return nullptr;
}

const rowdot::MatmulFn g_rowdot = pick_rowdot();

// x (M rows of K) packed once for the AVX-512 pairs loops (5 rows or more), for every part of a call to read
// (it was once a part: 8 rows x K floats copied ~450 times a decode step of the bench model);
// null where those loops do not run.
const float* pack_for_parts(const float* x, int M, int K, std::vector<float>& buf, ThreadPool& tp) {
#ifdef MLXQ_PA_HAVE_AVX2
  if (g_rowdot == &rowdot::avx512::matmul) {
    float* p = rowdot::avx512::pairs_buffer(M, K, buf);
    // Large ones (a batch-64 step's rows: 64 x 512 floats and more) on the pool's threads: packed
    // on the stream thread alone, they were ~2% of a batch-64 decode step (perf, the bench model).
    if (p != nullptr)
      split_ranges(tp, (M + 1) / 2, (int64_t)M * K, 1,
                   [&](int64_t p0, int64_t p1) { rowdot::avx512::pack_pairs_range(x, K, M, K, p, (int)p0, (int)p1); });
    return p;
  }
#endif
  return nullptr;
}

} // namespace

void set_blas(uintptr_t sgemm, uintptr_t sgemv, uintptr_t set_threads, uintptr_t get_threads) {
  if (sgemm == 0 || sgemv == 0)
    throw std::invalid_argument("set_blas: sgemm and sgemv are required");
  // Kept for the life of the process (a graph built before a second call may still run).
  auto* b = new Blas{reinterpret_cast<SgemmFn>(sgemm), reinterpret_cast<SgemvFn>(sgemv),
                     reinterpret_cast<SetThreadsFn>(set_threads), reinterpret_cast<GetThreadsFn>(get_threads)};
  g_blas.store(b);
}

bool has_blas() {
  return g_blas.load() != nullptr;
}

rowdot::MatmulFn rowdot_loops() {
  return g_rowdot;
}

const float* rowdot_pack(const float* x, int M, int K, std::vector<float>& buf) {
  return pack_for_parts(x, M, K, buf, pool());
}

const char* linear_isa() {
  if (g_rowdot == nullptr)
    return "blas";
#ifdef MLXQ_PA_HAVE_AVX2
  if (g_rowdot == &rowdot::avx512::matmul)
    return "avx512vl";
#endif
  return "avx2";
}

std::vector<mx::array> linear_group(
    const mx::array& x,
    const std::vector<mx::array>& ws,
    const std::vector<mx::array>& biases) {
  if (!has_blas())
    throw std::runtime_error("linear: no BLAS set (set_blas)");
  if (ws.empty())
    throw std::invalid_argument("linear: at least one weight");
  if (!biases.empty() && biases.size() != ws.size())
    throw std::invalid_argument("linear: one bias per weight, or none");
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) == 0)
    throw std::invalid_argument("linear: x must be float32 (..., K) with K positive");
  std::vector<mx::Shape> shapes;
  for (size_t g = 0; g < ws.size(); ++g) {
    const auto& w = ws[g];
    if (w.dtype() != mx::float32 || (!biases.empty() && biases[g].dtype() != mx::float32))
      throw std::invalid_argument("linear: float32 only");
    if (w.ndim() != 2 || w.shape(1) != x.shape(-1))
      throw std::invalid_argument("linear: w must be (N, K) for x (..., K)");
    if (w.shape(0) == 0)
      throw std::invalid_argument("linear: K and N must be positive");
    if (!biases.empty() && (biases[g].ndim() != 1 || biases[g].shape(0) != w.shape(0)))
      throw std::invalid_argument("linear: bias must be (N,)");
    auto shape = x.shape();
    shape.back() = w.shape(0);
    shapes.push_back(shape);
  }
  std::vector<mx::array> inputs = {x};
  inputs.insert(inputs.end(), ws.begin(), ws.end());
  inputs.insert(inputs.end(), biases.begin(), biases.end());
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  auto prim = std::make_shared<Linear>(s, (int)ws.size(), !biases.empty());
  if (ws.size() == 1)
    return {mx::array(shapes[0], mx::float32, prim, std::move(inputs))};
  return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(ws.size(), mx::float32), prim,
                                std::move(inputs));
}

mx::array linear(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias) {
  std::vector<mx::array> biases;
  if (bias)
    biases.push_back(*bias);
  return linear_group(x, {w}, biases)[0];
}

namespace {

// Columns [c0, c1) of target t, for M rows of x (K wide).
void run_part(const Blas* blas, const LinearTarget& t, const float* xp, const float* xpairs, int M, int K, int c0,
              int c1) {
  const int nc = c1 - c0;
  if (nc <= 0)
    return;
  // With a bias, the output starts as the bias and the loop or the BLAS adds to it (beta 1).
  const float beta = t.bias != nullptr ? 1.0f : 0.0f;
  if (t.bias != nullptr)
    for (int m = 0; m < M; ++m)
      for (int n = c0; n < c1; ++n)
        t.y[(int64_t)m * t.N + n] = t.bias[n * t.bias_stride];
  if (t.w_rows && g_rowdot != nullptr) {
    g_rowdot(xp, K, M, t.w, t.ldw, t.y, t.N, K, c0, c1, t.bias != nullptr, xpairs);
    return;
  }
  if (M == 1) {
    if (t.w_rows)
      blas->sgemv(kRowMajor, kNoTrans, nc, K, 1.0f, t.w + (int64_t)c0 * t.ldw, t.ldw, xp, 1, beta, t.y + c0, 1);
    else
      blas->sgemv(kColMajor, kNoTrans, nc, K, 1.0f, t.w + c0, t.ldw, xp, 1, beta, t.y + c0, 1);
  } else if (t.w_rows) {
    blas->sgemm(kRowMajor, kNoTrans, kTrans, M, nc, K, 1.0f, xp, K, t.w + (int64_t)c0 * t.ldw, t.ldw, beta,
                t.y + c0, t.N);
  } else {
    blas->sgemm(kRowMajor, kNoTrans, kNoTrans, M, nc, K, 1.0f, xp, K, t.w + c0, t.ldw, beta, t.y + c0, t.N);
  }
}

struct Part {
  int target, c0, c1;
};

} // namespace

LinearTarget linear_target(const mx::array& weight, const mx::array* bias, int K, mx::cpu::CommandEncoder& encoder) {
  // w's layout: rows contiguous, columns contiguous; anything else is copied to rows first.
  mx::array w = weight;
  const int N = w.shape(0);
  LinearTarget t{nullptr, true, K, N, nullptr, 0, nullptr};
  if (w.strides()[1] == 1 && w.strides()[0] >= K) {
    t.ldw = (int)w.strides()[0];
  } else if (w.strides()[0] == 1 && w.strides()[1] >= N) {
    t.w_rows = false;
    t.ldw = (int)w.strides()[1];
  } else {
    w = row_contiguous(w, encoder);
  }
  encoder.set_input_array(w);
  t.w = w.data<float>();
  if (bias != nullptr) {
    encoder.set_input_array(*bias);
    t.bias = bias->data<float>();
    t.bias_stride = bias->strides()[0];
  }
  return t;
}

void linear_run(const std::vector<LinearTarget>& targets, const float* xp, int M, int K) {
  const Blas* blas = g_blas.load();
  ThreadPool& tp = pool();
  // Each target split exactly as linear() alone splits it (multiples of kColAlign columns),
  // so each BLAS call is the one it would make alone and grouping changes no bit (OpenBLAS's
  // sgemm may round a column differently when its part is wider; our loops never do); every
  // part of every target goes to the pool in one pass.
  const int want = tp.size() * (M == 1 || g_rowdot != nullptr ? kPartsPerThread : 1);
  std::vector<Part> parts;
  for (int g = 0; g < (int)targets.size(); ++g) {
    const int N = targets[g].N;
    const int n = std::max(1, std::min(want, (N + kColAlign - 1) / kColAlign));
    const int per = ((N + n - 1) / n + kColAlign - 1) / kColAlign * kColAlign;
    for (int c0 = 0; c0 < N; c0 += per)
      parts.push_back({g, c0, std::min(N, c0 + per)});
  }
  // Kept by this thread (MLX's stream thread runs one op at a time) from call to call: since
  // 9 rows and more go in pairs too, a batch-64 call packs ~300 KB, not worth a malloc each time.
  thread_local std::vector<float> pairs;
  const float* xpairs = pack_for_parts(xp, M, K, pairs, tp);
  if (parts.size() == 1) { // on this thread (a BLAS call keeps the BLAS's own threads)
    run_part(blas, targets[0], xp, xpairs, M, K, parts[0].c0, parts[0].c1);
    return;
  }
  // The BLAS runs single-threaded while its calls are the pool's parts; our loops never
  // call it, so then its thread count is left alone.
  const bool calls_blas = g_rowdot == nullptr ||
      std::any_of(targets.begin(), targets.end(), [](const LinearTarget& t) { return !t.w_rows; });
  const int prev = calls_blas && blas->get_threads != nullptr ? blas->get_threads() : 1;
  if (prev != 1 && blas->set_threads != nullptr)
    blas->set_threads(1);
  tp.parallel_for((int)parts.size(), [&](int p) {
    const Part& q = parts[p];
    run_part(blas, targets[q.target], xp, xpairs, M, K, q.c0, q.c1);
  });
  if (prev != 1 && blas->set_threads != nullptr)
    blas->set_threads(prev);
}

void Linear::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const int K = inputs[1].shape(1);
  const int M = (int)(inputs[0].size() / (size_t)K);
  mx::array x = row_contiguous(inputs[0], encoder);
  encoder.set_input_array(x);
  std::vector<LinearTarget> targets;
  for (int g = 0; g < groups_; ++g) {
    auto t = linear_target(inputs[1 + g], has_bias_ ? &inputs[1 + groups_ + g] : nullptr, K, encoder);
    auto& out = outputs[g];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
    t.y = out.data<float>();
    targets.push_back(t);
  }
  const float* xp = x.data<float>();
  encoder.dispatch([M, K, xp, targets]() { linear_run(targets, xp, M, K); });
}

bool Linear::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Linear&>(other);
  return groups_ == o.groups_ && has_bias_ == o.has_bias_;
}

} // namespace mlxq
