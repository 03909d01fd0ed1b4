// The weight matmuls of a decode step (rowdot_impl.h) on the bench model's shapes, without MLX,
// and the AVX-512 loops' outputs against the AVX2 loops' bit for bit.
//
//   g++ -O3 -std=c++20 -mavx2 -mfma -mavx512f -mavx512vl -pthread -o /tmp/rowdot_rows bench/harness/rowdot_rows.cpp
//   /tmp/rowdot_rows 8 0 2    # M rows, mode (0 AVX-512, 1 AVX2, 2 compare bits, 3 AVX-512 with
//                             # every weight row read from one row: the multiply-adds from L1), threads
//   /tmp/rowdot_rows 64 4 2   # mode 4: AVX2 with the weights from L1
//   XOFF=2 WOFF=2 /tmp/rowdot_rows 8 4 1   # x and the weights 2 floats past a 64-byte line, as MLX's
//                             # CPU buffers start 8 bytes past one (default 0: on a line)
// Where the CPU has no AVX-512 (an AMD Zen 3 VM, 2026-11-27), build with -mavx2 -mfma alone: then
// only modes 1 and 4 run.
//
// Per layer (8) the fused q/k/v (1024 x 512), o (512 x 512), gate/up (2368 x 512) and down
// (512 x 1184), then the 8192 x 512 head: 100 MB of fp32 weights, each matmul's output rows split
// evenly over the threads, 4 parts a thread (as linear's pool splits them; x packed once a thread
// for the AVX-512 pairs loops, once a call there). Best of 15 passes.
#ifdef __AVX512F__
#include "../../worker/engine/kernels/csrc/rowdot_avx512.cpp" // the two builds' loops, as compiled
#undef ROWDOT_NS
#undef ROWDOT_NR
#undef ROWDOT_ZMM
#endif
#include "../../worker/engine/kernels/csrc/rowdot_avx2.cpp"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  if (argc < 3)
    return fprintf(stderr, "usage: rowdot_rows M mode [threads]\n"), 2;
  const int M = atoi(argv[1]), mode = atoi(argv[2]), T = argc > 3 ? atoi(argv[3]) : 1;
  struct Shape {
    int N, K;
  };
  std::vector<Shape> shapes;
  for (int l = 0; l < 8; ++l)
    for (Shape s : {Shape{1024, 512}, Shape{512, 512}, Shape{2368, 512}, Shape{512, 1184}})
      shapes.push_back(s);
  shapes.push_back({8192, 512});
  // Where x and each weight matrix start: off floats past a 64-byte line.
  struct Placed {
    std::vector<float> own;
    float* p = nullptr;
    size_t n = 0;
    Placed(size_t n_, int off) : own(n_ + 16 + off), n(n_) { // room for the line and the offset
      const uintptr_t a = reinterpret_cast<uintptr_t>(own.data());
      p = own.data() + ((64 - (a & 63)) & 63) / sizeof(float) + off;
    }
    float* data() { return p; }
    size_t size() const { return n; }
    float& operator[](size_t i) { return p[i]; }
  };
  const int xoff = getenv("XOFF") ? atoi(getenv("XOFF")) : 0, woff = getenv("WOFF") ? atoi(getenv("WOFF")) : 0;
  std::vector<Placed> W;
  for (const Shape& s : shapes) {
    W.emplace_back((size_t)s.N * s.K, woff);
    for (size_t i = 0; i < W.back().size(); ++i)
      W.back()[i] = ((i * 2654435761u) % 1000) / 1000.f - 0.5f;
  }
  const int ldx = 1184;
  Placed x((size_t)M * ldx, xoff);
  std::vector<float> y((size_t)M * 8192), y2(y.size());
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = ((i * 31) % 97) / 97.f - 0.5f;
#ifndef __AVX512F__
  if (mode != 1 && mode != 4)
    return fprintf(stderr, "built without AVX-512: modes 1 and 4 only\n"), 2;
#else
  if (mode == 2) {
    size_t bad = 0;
    for (size_t s = 0; s < shapes.size(); ++s)
      for (int K : {shapes[s].K, shapes[s].K - 3}) { // and a K % 8 tail
        const int N = shapes[s].N;
        std::vector<float> buf;
        const float* xp = mlxq::rowdot::avx512::pack_pairs(x.data(), ldx, M, K, buf);
        mlxq::rowdot::avx512::matmul(x.data(), ldx, M, W[s].data(), shapes[s].K, y.data(), N, K, 0, N / 2, false, xp);
        mlxq::rowdot::avx512::matmul(x.data(), ldx, M, W[s].data(), shapes[s].K, y.data(), N, K, N / 2, N, false,
                                     nullptr);
        mlxq::rowdot::avx2::matmul(x.data(), ldx, M, W[s].data(), shapes[s].K, y2.data(), N, K, 0, N, false, nullptr);
        for (int i = 0; i < M * N; ++i)
          bad += memcmp(&y[i], &y2[i], 4) != 0;
      }
    printf("M=%d: %zu outputs differ between the AVX-512 and AVX2 loops\n", M, bad);
    return bad != 0;
  }
#endif
  const int kParts = 4;
  const bool avx2 = mode == 1 || mode == 4;
#ifdef __AVX512F__
  const auto fn = avx2 ? mlxq::rowdot::avx2::matmul : mlxq::rowdot::avx512::matmul;
#else
  const auto fn = mlxq::rowdot::avx2::matmul;
#endif
  const bool from_l1 = mode == 3 || mode == 4; // a row stride of 0: each weight row is the matrix's first
  double best = 1e9;
  for (int r = 0; r < 15; ++r) {
    const double t0 = now();
    auto work = [&](int t) {
      std::vector<float> buf;
      for (size_t s = 0; s < shapes.size(); ++s) {
        const auto [N, K] = shapes[s];
#ifdef __AVX512F__
        const float* xp = !avx2 ? mlxq::rowdot::avx512::pack_pairs(x.data(), ldx, M, K, buf) : nullptr;
#else
        const float* xp = nullptr;
#endif
        for (int p = 0; p < kParts; ++p) { // linear's parts: kPartsPerThread a thread
          const int c0 = N * (t * kParts + p) / (T * kParts), c1 = N * (t * kParts + p + 1) / (T * kParts);
          fn(x.data(), ldx, M, W[s].data(), from_l1 ? 0 : K, y.data(), N, K, c0, c1, false, xp);
        }
      }
    };
    std::vector<std::thread> th;
    for (int t = 1; t < T; ++t)
      th.emplace_back(work, t);
    work(0);
    for (auto& h : th)
      h.join();
    best = std::min(best, now() - t0);
  }
  const char* name[] = {"avx512", "avx2", "", "avx512, weights from L1", "avx2, weights from L1"};
  printf("M=%d %s, %d thread(s): %.2f ms\n", M, name[mode], T, best * 1e3);
}
