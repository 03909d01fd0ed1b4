// The paged attention's inner function against a plain read of the same bytes, without MLX.
//
//   g++ -O3 -std=c++17 -mavx2 -mfma -mavx512f -mavx512vl -ffp-contract=fast -pthread \
//       -o /tmp/attend_vs_read bench/harness/attend_vs_read.cpp
//   /tmp/attend_vs_read 64 85 0   # B rows, context, mode: 0 attend (one thread), 1 read, 2 attend (two threads),
//                                 # 3 read (two threads)
//
// An fp32 pool laid out as the engine's (per layer a K and a V array of (4 heads, slots, 64)),
// 8 layers, each row's blocks consecutive; mode 0 runs avx512::attend() task by task as the op's
// plan orders them (head by head, rows in block order, each prefetching the next), mode 1 sums the
// same K and V rows in the same order and does nothing else, mode 2 is mode 0 on two threads (a thread
// started per layer, in both two-thread modes), mode 3 mode 1 on two threads with mode 2's deal.
// 2026-11-27 02:45, 64 rows at 118 tokens, three rounds: attend one thread 9.9-10.1 ms, read 10.0-10.2;
// on two threads attend 6.5-7.3 ms, read 5.2-6.1. In a slower spell at 03:40: attend 9.3-11.7, read
// 8.8-9.7.
// Best of 20 passes over the 8 layers. Needs AVX-512VL (the avx2 build: change PA_NS and the flags).
#define PA_NS avx512
#define PA_TQ 4
#define PA_NV 4
#define PA_ZMM 4
#include "../../worker/engine/kernels/csrc/pa_kernel_impl.h"
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
using namespace mlxq_pa; using namespace mlxq_pa::avx512;
static double now(){ return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  const int B = atoi(argv[1]), ctx = atoi(argv[2]), mode = atoi(argv[3]), L = 8, H = 4, Hq = 8, D = 64, BS = 32;
  const int nb = (ctx + BS - 1) / BS, NBLK = B * nb + 1;
  const size_t per = (size_t)H * NBLK * BS * D;
  std::vector<float*> K(L), V(L);
  for (int l = 0; l < L; ++l) for (float** p : {&K[l], &V[l]}) {
    *p = (float*)mmap(nullptr, per * 4, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
    for (size_t i = 0; i < per; ++i) (*p)[i] = ((i * 2654435761u) % 1000) / 1000.f - 0.5f;
  }
  std::vector<int32_t> tables(B * nb), qoff(B), kvl(B);
  for (int b = 0; b < B; ++b) { for (int t = 0; t < nb; ++t) tables[b * nb + t] = b * nb + t; kvl[b] = ctx; qoff[b] = ctx - 1; }
  const int G = Hq / H;
  std::vector<float> q((size_t)B * Hq * D), st((size_t)B * H * G * (D + 2)), scratch(BS * 2 * D);
  for (size_t i = 0; i < q.size(); ++i) q[i] = ((i * 31) % 100) / 100.f - 0.5f;
  std::vector<Member> mem(B * H);
  for (int h = 0; h < H; ++h) for (int b = 0; b < B; ++b) {
    float* s = st.data() + ((size_t)h * B + b) * G * (D + 2);
    mem[h * B + b] = {b, 0, nb, q.data() + ((size_t)b * Hq + h * G) * D, s, s + G, s + 2 * G};
  }
  double best = 1e9; float sink = 0;
  for (int r = 0; r < 20; ++r) {
    double t0 = now();
    for (int l = 0; l < L; ++l) {
      Args a{}; a.k = K[l]; a.v = V[l]; a.tables = tables.data(); a.q_off = qoff.data(); a.kv_len = kvl.data();
      a.pool_type = PoolType::f32; a.B = B; a.Hq = Hq; a.Hkv = H; a.N = 1; a.Dk = D; a.Dv = D; a.nb = nb;
      a.num_blocks = NBLK; a.block_size = BS; a.window = 0;
      // The read modes: sum task i's K and V rows (head i / B, row i % B), block by block.
      auto read_task = [&](int i, vf& a0, vf& a1) {
        const int rows_last = ((ctx - (nb - 1) * BS) + 7) & ~7;
        for (int t = 0; t < nb; ++t) {
          const int rows = t == nb - 1 ? rows_last : BS;
          const size_t off = ((size_t)(i / B) * NBLK * BS + (size_t)((i % B) * nb + t) * BS) * D;
          for (const float* src : {K[l] + off, V[l] + off})
            for (int e = 0; e < rows * D; e += 16) {
              a0 += load(src + e);
              a1 += load(src + e + 8);
            }
        }
      };
      if (mode == 2) {
        auto work = [&](int part) {
          std::vector<float> scr(BS * 2 * D);
          int pref = 0; const int n = H * B, C = 5;
          for (int c0 = part * C; c0 < n; c0 += 2 * C)
            for (int i = c0; i < std::min(n, c0 + C); ++i) {
              const int h = i / B;
              Next nx{0, nullptr, 0};
              const bool has = i + 1 < std::min(n, c0 + C);
              if (has) nx = {(i + 1) / B, &mem[i + 1], 1};
              pref = avx512::attend(a, h, &mem[i], 1, scr.data(), has ? &nx : nullptr, pref);
            }
        };
        std::thread th(work, 1); work(0); th.join();
      } else if (mode == 0) {
        int pref = 0;
        for (int h = 0; h < H; ++h) for (int b = 0; b < B; ++b) {
          const int i = h * B + b;
          Next nx{0, nullptr, 0};
          const bool has = i + 1 < H * B;
          if (has) nx = {(i + 1) / B, &mem[i + 1], 1};
          pref = avx512::attend(a, h, &mem[i], 1, scratch.data(), has ? &nx : nullptr, pref);
        }
      } else if (mode == 3) { // mode 1's read on two threads, the tasks dealt as mode 2 deals them
        float sinks[2] = {0, 0};
        auto work = [&](int part) {
          vf a0 = splat(0), a1 = splat(0);
          const int n = H * B, C = 5;
          for (int c0 = part * C; c0 < n; c0 += 2 * C)
            for (int i = c0; i < std::min(n, c0 + C); ++i)
              read_task(i, a0, a1);
          sinks[part] = hsum(a0 + a1);
        };
        std::thread th(work, 1); work(0); th.join();
        sink += sinks[0] + sinks[1];
      } else {
        vf a0 = splat(0), a1 = splat(0);
        for (int i = 0; i < H * B; ++i)
          read_task(i, a0, a1);
        sink += hsum(a0 + a1);
      }
    }
    best = std::min(best, now() - t0);
  }
  printf("B=%d ctx=%d mode=%s: %.2f ms (%f)\n", B, ctx, mode == 1 ? "read" : mode == 3 ? "read2thr" : mode == 2 ? "attend2thr" : "attend", best * 1e3, sink + st[5]);
}
