// The paged attention's inner function on rows that share their blocks (n forked samples of one
// prompt), without MLX, and the same outputs from the AVX2 loop bit for bit.
//
//   g++ -O3 -std=c++20 -mavx2 -mfma -mavx512f -mavx512vl -pthread -o /tmp/attend_fork bench/harness/attend_fork.cpp
//   /tmp/attend_fork 8 1064 0    # R rows, context, mode: 0 AVX-512 (one thread), 1 AVX2 (one thread),
//                                # 2 compare the two builds' bits, 3 AVX-512 on two threads in parts,
//                                # 4 AVX-512 (one thread) with every block read from one pool block
//                                # (its K and V in L1: the arithmetic alone)
//   /tmp/attend_fork 3 77 2 5    # a 4th argument: N queried tokens a row (a prefill chunk)
//                                # 5: AVX2 (one thread) with the blocks from L1, 6: AVX2 on two threads
//                                # in parts
// Where the CPU has no AVX-512 (an AMD Zen 3 VM, 2026-11-27), build with -mavx2 -mfma alone: then
// only modes 1, 5 and 6 run.
//
// An fp32 pool as the engine's (per layer a K and a V array of (4 heads, slots, 64)), 8 layers, 8
// query heads; all R rows read the same blocks (lengths ctx, ctx - 1, ctx - 2, ...), one task of R
// members per head (mode 3: per head and part of 16 blocks, the tasks dealt to two threads, as the
// op's plan splits long rows). Best of 30 passes. Needs AVX-512VL. On a shared VM, pin the one-thread
// modes to a core (taskset -c 1 /tmp/attend_fork ...): unpinned, the same binary's best of 30 moved
// between 1.7 and 2.9 ms from one run to the next (8 rows, mode 4, 2026-11-27), pinned by 2% while
// the other tenants were quiet (bench/harness/fma_rate.cpp at its usual ~5.4 G a second; at 4.1 G
// the pinned runs moved as much as the unpinned ones).
#ifdef __AVX512F__
#include "../../worker/engine/kernels/csrc/pa_kernel_avx512.cpp" // the two builds' loops, as compiled
#undef PA_NS
#undef PA_TQ
#undef PA_ZMM
#endif
#include "../../worker/engine/kernels/csrc/pa_kernel_avx2.cpp"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
using namespace mlxq_pa;
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
int main(int argc, char** argv) {
  if (argc < 4)
    return fprintf(stderr, "usage: attend_fork R ctx mode [N]\n"), 2;
  const int R = atoi(argv[1]), ctx = atoi(argv[2]), mode = atoi(argv[3]), L = 8, H = 4, Hq = 8, D = 64, BS = 32;
  const int N = argc > 4 ? atoi(argv[4]) : 1;
  const int nb = (ctx + BS - 1) / BS, NBLK = nb + 1, G = Hq / H, GN = G * N;
  const size_t per = (size_t)H * NBLK * BS * D;
  std::vector<std::vector<float>> K(L, std::vector<float>(per)), V(L, std::vector<float>(per));
  for (int l = 0; l < L; ++l)
    for (size_t i = 0; i < per; ++i) {
      K[l][i] = ((i * 2654435761u + l) % 1000) / 1000.f - 0.5f;
      V[l][i] = ((i * 40503u + 7 * l) % 997) / 997.f - 0.5f;
    }
  std::vector<int32_t> tables(R * nb), qoff(R), kvl(R);
  for (int b = 0; b < R; ++b) {
    for (int t = 0; t < nb; ++t)
      tables[b * nb + t] = mode == 4 || mode == 5 ? 0 : t;
    kvl[b] = ctx - (b % 3);
    qoff[b] = kvl[b] - N;
  }
  std::vector<float> q((size_t)R * H * GN * D);
  for (size_t i = 0; i < q.size(); ++i)
    q[i] = ((i * 31 + i / 7) % 100) / 100.f - 0.5f;
  auto args = [&](int l) {
    Args a{};
    a.k = K[l].data(); a.v = V[l].data(); a.tables = tables.data(); a.q_off = qoff.data(); a.kv_len = kvl.data();
    a.pool_type = PoolType::f32; a.B = R; a.Hq = Hq; a.Hkv = H; a.N = N; a.Dk = D; a.Dv = D; a.nb = nb;
    a.num_blocks = NBLK; a.block_size = BS; a.window = 0;
    return a;
  };
  // Tasks (head, part) from `first`, every `step`-th, parts of PB blocks; st: per task and row its (m, l, acc).
  const int PB = mode == 3 || mode == 6 ? 16 : nb, np = (nb + PB - 1) / PB;
  auto run = [&](AttendFn fn, std::vector<float>& st, int first, int step) {
    std::vector<float> scratch(BS * 2 * D);
    std::vector<Member> mem(R);
    for (int l = 0; l < L; ++l) {
      const Args a = args(l);
      for (int task = first; task < H * np; task += step) {
        const int h = task / np, pp = task % np;
        for (int b = 0; b < R; ++b) {
          float* s = st.data() + ((((size_t)l * H + h) * np + pp) * R + b) * GN * (D + 2);
          mem[b] = {b, pp * PB, std::min(nb, (pp + 1) * PB), q.data() + ((size_t)b * H + h) * GN * D, s, s + GN,
                    s + 2 * GN};
        }
        fn(a, h, mem.data(), R, scratch.data(), nullptr, 0);
      }
    }
  };
  std::vector<float> st((size_t)L * H * np * R * GN * (D + 2)), st2(st.size());
#ifndef __AVX512F__
  if (mode != 1 && mode != 5 && mode != 6)
    return fprintf(stderr, "built without AVX-512: modes 1, 5 and 6 only\n"), 2;
  const AttendFn wide = avx2::attend;
#else
  const AttendFn wide = avx512::attend;
  if (mode == 2) {
    run(avx512::attend, st, 0, 1);
    run(avx2::attend, st2, 0, 1);
    size_t bad = 0;
    for (size_t i = 0; i < st.size(); ++i)
      bad += memcmp(&st[i], &st2[i], 4) != 0;
    printf("R=%d ctx=%d N=%d: %zu of %zu outputs differ between the AVX-512 and AVX2 loops\n", R, ctx, N, bad,
           st.size());
    return bad != 0;
  }
#endif
  const bool avx2 = mode == 1 || mode == 5 || mode == 6;
  const AttendFn fn = avx2 ? avx2::attend : wide;
  double best = 1e9;
  for (int r = 0; r < 30; ++r) {
    const double t0 = now();
    if (mode == 3 || mode == 6) {
      std::thread t1([&] { run(fn, st, 1, 2); });
      run(fn, st, 0, 2);
      t1.join();
    } else {
      run(fn, st, 0, 1);
    }
    best = std::min(best, now() - t0);
  }
  const char* name[] = {"avx512, one thread", "avx2, one thread", "", "avx512, two threads in parts",
                        "avx512, one thread, blocks from L1", "avx2, one thread, blocks from L1",
                        "avx2, two threads in parts"};
  printf("R=%d ctx=%d N=%d %s: %.3f ms\n", R, ctx, N, name[mode], best * 1e3);
}
