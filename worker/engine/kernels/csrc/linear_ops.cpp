// linear as one CPU primitive over the pool and the BLAS; see linear_ops.h.
#include "linear_ops.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "gemv.h"
#include "row_contiguous.h"
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

// One row: parts per pool thread. A part is claimed by whichever thread is free, so
// with several per thread a worker that wakes late still takes its share (with one
// each, the calling thread ran both halves while the worker woke: ~13% of a solo
// decode step on the bench model).
constexpr int kRowPartsPerThread = 4;

// gemv_avx2.cpp where the CPU has AVX2 and FMA (MLXQ_ATTN_ISA=generic: the BLAS's sgemv).
bool pick_gemv() {
#ifdef MLXQ_PA_HAVE_AVX2
  const char* want = std::getenv("MLXQ_ATTN_ISA");
  if (want != nullptr && std::string(want) == "generic")
    return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

const bool g_own_gemv = pick_gemv();

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

mx::array linear(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias) {
  if (!has_blas())
    throw std::runtime_error("linear: no BLAS set (set_blas)");
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32 || (bias && bias->dtype() != mx::float32))
    throw std::invalid_argument("linear: float32 only");
  if (x.ndim() < 1 || w.ndim() != 2 || w.shape(1) != x.shape(-1))
    throw std::invalid_argument("linear: w must be (N, K) for x (..., K)");
  if (bias && (bias->ndim() != 1 || bias->shape(0) != w.shape(0)))
    throw std::invalid_argument("linear: bias must be (N,)");
  if (x.shape(-1) == 0 || w.shape(0) == 0)
    throw std::invalid_argument("linear: K and N must be positive");
  auto shape = x.shape();
  shape.back() = w.shape(0);
  std::vector<mx::array> inputs = {x, w};
  if (bias)
    inputs.push_back(*bias);
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  return mx::array(shape, mx::float32, std::make_shared<Linear>(s), std::move(inputs));
}

void Linear::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const mx::array& w_in = inputs[1];
  const int N = w_in.shape(0), K = w_in.shape(1);
  const int M = (int)(inputs[0].size() / (size_t)K);
  // w's layout: rows contiguous (a weight as stored), columns contiguous (a transposed
  // view); anything else is copied to rows first.
  bool w_rows = true;
  int ldw = K;
  mx::array w = w_in;
  if (w.strides()[1] == 1 && w.strides()[0] >= K) {
    ldw = (int)w.strides()[0];
  } else if (w.strides()[0] == 1 && w.strides()[1] >= N) {
    w_rows = false;
    ldw = (int)w.strides()[1];
  } else {
    w = row_contiguous(w, encoder);
  }
  mx::array x = row_contiguous(inputs[0], encoder);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_input_array(x);
  encoder.set_input_array(w);
  const float* bp = nullptr;
  int64_t bs = 0;
  if (inputs.size() > 2) {
    encoder.set_input_array(inputs[2]);
    bp = inputs[2].data<float>();
    bs = inputs[2].strides()[0];
  }
  encoder.set_output_array(out);
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  float* yp = out.data<float>();
  const Blas* blas = g_blas.load();
  encoder.dispatch([blas, M, N, K, xp, wp, w_rows, ldw, bp, bs, yp]() {
    // With a bias, the output starts as the bias and the BLAS adds to it (beta 1).
    const float beta = bp != nullptr ? 1.0f : 0.0f;
    ThreadPool& tp = pool();
    // Columns [c0, c1) of the output.
    auto run = [&](int c0, int c1) {
      const int nc = c1 - c0;
      if (nc <= 0)
        return;
      if (bp != nullptr)
        for (int m = 0; m < M; ++m)
          for (int n = c0; n < c1; ++n)
            yp[(int64_t)m * N + n] = bp[n * bs];
      if (M == 1) {
#ifdef MLXQ_PA_HAVE_AVX2
        if (w_rows && g_own_gemv)
          gemv_avx2::rows(wp, ldw, xp, yp, K, c0, c1, bp != nullptr);
        else
#endif
        if (w_rows)
          blas->sgemv(kRowMajor, kNoTrans, nc, K, 1.0f, wp + (int64_t)c0 * ldw, ldw, xp, 1, beta, yp + c0, 1);
        else
          blas->sgemv(kColMajor, kNoTrans, nc, K, 1.0f, wp + c0, ldw, xp, 1, beta, yp + c0, 1);
      } else if (w_rows) {
        blas->sgemm(kRowMajor, kNoTrans, kTrans, M, nc, K, 1.0f, xp, K, wp + (int64_t)c0 * ldw, ldw, beta,
                    yp + c0, N);
      } else {
        blas->sgemm(kRowMajor, kNoTrans, kNoTrans, M, nc, K, 1.0f, xp, K, wp + c0, ldw, beta, yp + c0, N);
      }
    };
    const int parts = std::min(tp.size() * (M == 1 ? kRowPartsPerThread : 1), (N + kColAlign - 1) / kColAlign);
    if (parts <= 1) {
      run(0, N);  // one thread of ours: the BLAS keeps its own thread count
      return;
    }
    const int prev = blas->get_threads != nullptr ? blas->get_threads() : 1;
    if (prev != 1 && blas->set_threads != nullptr)
      blas->set_threads(1);
    const int per = ((N + parts - 1) / parts + kColAlign - 1) / kColAlign * kColAlign;
    tp.parallel_for(parts, [&](int p) { run(std::min(N, p * per), std::min(N, (p + 1) * per)); });
    if (prev != 1 && blas->set_threads != nullptr)
      blas->set_threads(prev);
  });
}

} // namespace mlxq
