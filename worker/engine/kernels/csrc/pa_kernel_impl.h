// The paged attention inner loop. Included by pa_kernel_generic.cpp,
// pa_kernel_avx2.cpp and pa_kernel_avx512.cpp with PA_NS set to the namespace of
// that build (and PA_TQ, PA_NV to its tile sizes).
//
// Per KV block (block_size keys, contiguous rows in the pool) and per query of
// the group (all G query heads that share the KV head, times the N tokens, of
// every row of the task on that block): scores for the keys the query may see,
// an online-softmax update of (m, l, acc), then acc += p * V. The block's K and V
// stay in L1 while every query uses them, so each K/V byte comes from memory once
// per (block, kv head), whatever G, N and the rows sharing it are. Queries that
// see the same keys go through in tiles of PA_TQ: each key or value vector loaded
// serves the whole tile, and the tile's independent chains keep the FMA units
// busy (8 forked rows over 1000 tokens, one thread: 0.44 -> 0.33 ms a layer with
// tiles of 4). A query's arithmetic does not depend on its tile.
//
// Vectorization is explicit, with GCC/Clang vector extensions (8 floats) for
// the dot products, the exponentials and the V accumulation; nothing depends
// on -ffast-math or on what the auto-vectorizer decides.
#include <cmath>
#include <cstring>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "pa_kernel.h"
#ifdef PA_ZMM
#include "pairs16.h"
#endif

#ifndef PA_NS
#error "define PA_NS before including pa_kernel_impl.h"
#endif

namespace mlxq_pa {
namespace PA_NS {
namespace {

typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));

constexpr int kMaxBlock = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vf v) {
  std::memcpy(p, &v, sizeof(v));
}

inline vf splat(float x) {
  return vf{x, x, x, x, x, x, x, x};
}

inline vi splat_i(int32_t x) {
  return vi{x, x, x, x, x, x, x, x};
}

inline float hsum(vf v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

template <class V, class I>
inline V select_t(I mask, V a, V b) {
  return (V)(((I)a & mask) | ((I)b & ~mask));
}

inline vf select(vi mask, vf a, vf b) {
  return select_t(mask, a, b);
}

// exp(x) for x <= 0 (Cephes' expf polynomial, ~1 ulp); exactly 0 below -87.3
// (so -inf gives 0, which masked keys rely on). V: 8 floats (vf, every build) or 16 (PA_ZMM's
// pairs); each lane the same operations either way.
template <class V, class I>
inline V vexp_t(V x) {
  const V zero = V{};
  const V lo = zero + -87.3f;
  const I dead = x < lo;
  x = select_t(dead, lo, x);
  x = select_t(x > zero, zero, x);
  V fx = x * (zero + 1.44269504088896341f) + (zero + 0.5f);
  I ti = __builtin_convertvector(fx, I); // toward zero
  V tf = __builtin_convertvector(ti, V);
  ti = ti + (I)(tf > fx); // floor: -1 where truncation went up
  tf = __builtin_convertvector(ti, V);
  x = x - tf * (zero + 0.693359375f) - tf * (zero + -2.12194440e-4f);
  const V z = x * x;
  V y = zero + 1.9875691500e-4f;
  y = y * x + (zero + 1.3981999507e-3f);
  y = y * x + (zero + 8.3334519073e-3f);
  y = y * x + (zero + 4.1665795894e-2f);
  y = y * x + (zero + 1.6666665459e-1f);
  y = y * x + (zero + 5.0000001201e-1f);
  y = y * z + x + (zero + 1.0f);
  const I e = (ti + 127) << 23;
  y = y * (V)e;
  return (V)((I)y & ~dead);
}

inline vf vexp(vf x) {
  return vexp_t<vf, vi>(x);
}

inline vf vmax(vf a, vf b) {
  return select(a > b, a, b);
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i)
    m = v[i] > m ? v[i] : m;
  return m;
}

// _mm256_hadd_ps: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7].
inline vf hadd(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
      __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    const float r = std::ldexp((float)mant, -24); // zero or subnormal
    return sign ? -r : r;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Rows [j0, j1) of one block of a 16-bit pool, to fp32 rows in dst.
void convert_rows(
    PoolType t,
    const uint16_t* src,
    float* dst,
    int D,
    int j0,
    int j1) {
  const int64_t n0 = (int64_t)j0 * D, n1 = (int64_t)j1 * D;
  if (t == PoolType::f16) {
    for (int64_t i = n0; i < n1; ++i)
      dst[i] = half_to_float(src[i]);
  } else {
    for (int64_t i = n0; i < n1; ++i)
      dst[i] = bf16_to_float(src[i]);
  }
}

inline float load_float(PoolType t, const void* p, int64_t i) {
  if (t == PoolType::f32)
    return ((const float*)p)[i];
  const uint16_t h = ((const uint16_t*)p)[i];
  return t == PoolType::f16 ? half_to_float(h) : bf16_to_float(h);
}

// Rows of a block, 8 floats at a time: at(j, d) is row j's elements [d, d + 8). F32Rows reads
// fp32 rows; U8Rows and U4Rows read mx.quantize's packed rows (element e in bits
// (e * bits) % 32 of uint32 word (e * bits) / 32) and give the integers q as floats, exactly:
// a quantized block's scales and biases are applied to the dot products and the weights
// (BlockAffine), never to the elements, so its rows are not dequantized to a float copy.
struct F32Rows {
  const float* p;
  int64_t ld; // floats per row
  inline vf at(int j, int d) const {
    return load(p + (int64_t)j * ld + d);
  }
};

struct U8Rows {
  const uint8_t* p;
  int64_t ld; // bytes per row
  inline vf at(int j, int d) const {
    const uint8_t* x = p + (int64_t)j * ld + d; // element e is byte e of the row (little-endian)
#ifdef __AVX2__
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)x)));
#else
    const vi q = {x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]};
    return __builtin_convertvector(q, vf);
#endif
  }
};

struct U4Rows {
  const uint32_t* p;
  int64_t ld; // words per row
  inline vf at(int j, int d) const {
    const int32_t x = (int32_t)p[(int64_t)j * ld + d / 8]; // elements d..d+7, 4 bits each
    const vi q = (splat_i(x) >> vi{0, 4, 8, 12, 16, 20, 24, 28}) & 15;
    return __builtin_convertvector(q, vf);
  }
};

// Rows [j0, j1) of src as fp32 rows of D floats in dst (a quantized block's integers, once for
// the several tiles of queries that attend it).
template <class Src>
void unpack_rows(const Src& src, float* dst, int D, int j0, int j1) {
  for (int j = j0; j < j1; ++j)
    for (int d = 0; d < D; d += 8)
      store(dst + (int64_t)j * D + d, src.at(j, d));
}

// A quantized block's affine groups as fp32: element d of row j is q * s + b with s =
// ks[g * ld + j], b = kb[g * ld + j] for its group g = d / group (vs, vb: the values'). A score
// is then sum_g s_g * (q . kq_g) + b_g * sum(q_g), and a value sum sum_j (p_j s_jg) vq_j +
// sum_j p_j b_jg: the decomposition of MLX's quantized matmul, with one multiply-add per element.
struct BlockAffine {
  const float* ks;
  const float* kb;
  const float* vs;
  const float* vb;
  int64_t ld;
  int group, ngk, ngv;
};

// Into L2 (prefetcht1), not L1: two blocks ahead they would evict the K and V the
// queries are still reading there (a block of one head is 16 KB of fp32 K and V).
inline void prefetch_rows(const char* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    __builtin_prefetch(p + o, 0, 2);
}

// kPrefetchAhead (pa_kernel.h), how far ahead a task prefetches its blocks: far enough that a
// block of shared rows (several queries' arithmetic on it) and a block of one row (read-bound)
// both find the next one arrived. With prefetcht1 (prefetch_rows), against one block ahead into L1, a
// decode step at 1000 tokens, interleaved A/B in one process: 8 forked rows 10.43 -> 9.75 ms,
// one row 6.64 -> 6.10 ms.

// The blocks ahead (kPrefetchAhead), queued and issued a few lines at a time from inside the
// arithmetic, so that their reads overlap it: a block's lines asked for at once (256 for fp32 K
// and V of one head) filled the core's miss buffers, and the core stalled on the prefetches
// until they drained. Blocks are queued in the order they are read; what is still queued for
// blocks up to t + 1 goes out when block t starts (a task's first block at once).
// Decode steps of the bench model, interleaved A/B in one process (medians of 5): 8 forked
// rows at 1000 tokens 8.48 -> 7.22 ms, one row at 1000 tokens 5.28 -> 5.17, 64 rows at 100
// tokens 31.6 -> 30.7. Only timing: the same bits.
// The pace (lines per step of the arithmetic: a tile's group of 8 keys, an accumulation pass)
// is set per block so that a block's steps issue about one block's lines (pace_for): a fixed 16
// lines issued 96 of a one-row block's 256 (the rest went out in bulk at the next block, and
// stalled there), and 384 of a block that 16 forked queries take in 4 tiles. Attention alone,
// 64 rows at 85 tokens, 8 layers, alternating in one process (medians of 9): 4.34 -> 3.76 ms;
// 8 forked rows at 1000 tokens 1.72 -> 1.72; the engine's decode step at batch 64: attention
// ~5% faster, within noise for 8 forked rows and one row.
class PrefetchQueue {
 public:
  void push(const char* p, int64_t bytes, int t) {
    if (n_ == kCap)
      issue_oldest();
    r_[(head_ + n_) % kCap] = {p, p + bytes, t};
    ++n_;
  }
  void pace(int lines) {
    pace_ = lines;
  }
  // One step's lines (pace), oldest first.
  inline void issue() {
    int lines = pace_;
    while (lines > 0 && n_ > 0) {
      Range& x = r_[head_];
      while (lines > 0 && x.p < x.end) {
        __builtin_prefetch(x.p, 0, 2);
        x.p += 64;
        --lines;
      }
      if (x.p >= x.end) {
        head_ = (head_ + 1) % kCap;
        --n_;
      }
    }
  }
  // Every line of the blocks up to t.
  void issue_upto(int t) {
    while (n_ > 0 && r_[head_].t <= t)
      issue_oldest();
  }

 private:
  struct Range {
    const char* p;
    const char* end;
    int t;
  };
  void issue_oldest() {
    const Range& x = r_[head_];
    prefetch_rows(x.p, x.end - x.p);
    head_ = (head_ + 1) % kCap;
    --n_;
  }
  static constexpr int kCap = 2 * kMaxMembers * (kPrefetchAhead + 1);
  Range r_[kCap];
  int head_ = 0, n_ = 0;
  int pace_ = 16;
};

// Queries per tile (PA_TQ) and 8-float vectors of V per accumulation pass (PA_NV): each
// build picks what its vector registers hold (a tile's TQ * 4 score and TQ * NV output
// accumulators, its TQ queries or weights, one key or value row).
#ifndef PA_TQ
#define PA_TQ 2
#endif
#ifndef PA_NV
#define PA_NV 4
#endif
constexpr int TQ = PA_TQ, NV = PA_NV;
#ifdef PA_ZMM
constexpr int kTileRows = TQ > 2 * PA_ZMM ? TQ : 2 * PA_ZMM; // the queries of a tile, at most
#else
constexpr int kTileRows = TQ;
#endif

// One query of a block: its row of the group (fp32, scaled), its (m, l, acc), the keys
// [jl, jh) of the block it may see, and (quantized pools) the sums of its row over each key
// group.
struct QRef {
  const float* q;
  float* m;
  float* l;
  float* acc;
  int jl, jh;
  const float* qsum;
  // PA_ZMM: this query and the next one (the next head of the same token), 8 floats of each in
  // turn (a pair buffer of 2 * Dk), when this query starts such a pair; else null.
  const float* q2;
};

// Vector registers of the build (x86-64: AVX-512 has 32, AVX2 and SSE 16).
#ifdef PA_ZMM
constexpr int kVecRegs = 32;
#else
constexpr int kVecRegs = 16;
#endif

// x stays in a register from here on: GCC would otherwise read it again from memory as an operand
// of each multiply-add that uses it (one load a multiply-add), its cost model blind to the loads.
inline void in_register(vf& x) {
#ifdef __AVX__
  asm("" : "+x"(x));
#else
  (void)x;
#endif
}

// dot4's lanes for keys j + u, u in [U0, U0 + KP): a[i][u] of query i.
template <int NQ, int U0, int KP, class Src>
inline void dot_keys(const QRef* qs, const Src& k, int j, int d0, int d1, vf (*a)[4]) {
  for (int i = 0; i < NQ; ++i)
    for (int u = U0; u < U0 + KP; ++u)
      a[i][u] = splat(0.0f);
  for (int d = d0; d < d1; d += 8) {
    vf x[NQ];
    for (int i = 0; i < NQ; ++i) {
      x[i] = load(qs[i].q + d);
      in_register(x[i]);
    }
    for (int u = U0; u < U0 + KP; ++u) {
      vf kv = k.at(j + u, d);
      in_register(kv); // one load of the key row, not one per query (see dot4)
      for (int i = 0; i < NQ; ++i)
        a[i][u] += x[i] * kv;
    }
  }
}

// Lane partials of NQ queries against rows j..j+3 of k, elements [d0, d1): lane l of key j
// sums q[d] * k_j[d] over d = d0 + l, d0 + l + 8, ... in order (fused multiply-adds from 0),
// then h[i] = [lo0..lo3, hi0..hi3] of query i with lo = (l0 + l1) + (l2 + l3) and hi =
// (l4 + l5) + (l6 + l7); the sum is lo + hi (attend_tile). A query's sums do not depend on NQ.
// The queries' rows and each key row are held in registers (in_register): otherwise GCC took the
// key row from memory as an operand of each query's multiply-add. With float blocks, 3 queries on
// 16 registers (AVX2) go through the 4 keys in one pass: 12 accumulators, 3 query rows and the key
// row, 7 loads per 12 multiply-adds and 12 independent chains. Before, they went in two passes of 2
// keys, each with 9 loads per 6 multiply-adds (the key row read once per query), bound by the
// loads. bench/harness/attend_fork.cpp, the AVX2 build on the AMD Zen 3 VM, 2026-11-27, runs
// alternating: 8 forked rows over 1020 tokens, blocks from L1, one thread pinned, 3.16-3.28 ->
// 2.91-3.02 ms (6 and 7 runs of 8; the others 3.6-4.6, the VM's other tenants busy); from memory
// on two threads, medians of 8, 2.76 -> 2.59 ms; one row (a tile of its 2 heads, the key row now
// held too), pinned, 0.61-0.74 -> 0.55-0.67 ms. Quantized blocks keep two passes where the one
// pass would fill every register: their key rows are converted in registers the one pass would
// not have (a choice by that count, not measured). A lane's sum is the same chain of multiply-adds
// either way: the same bits.
template <int NQ, class Src>
inline void dot4(const QRef* qs, const Src& k, int j, int d0, int d1, vf* h) {
  vf a[NQ][4];
  constexpr int one_pass = 4 * NQ + NQ + 1; // registers: the accumulators, the queries' rows, a key row
  if constexpr (one_pass < kVecRegs || (one_pass == kVecRegs && std::is_same_v<Src, F32Rows>)) {
    dot_keys<NQ, 0, 4>(qs, k, j, d0, d1, a);
  } else {
    dot_keys<NQ, 0, 2>(qs, k, j, d0, d1, a);
    dot_keys<NQ, 2, 2>(qs, k, j, d0, d1, a);
  }
  for (int i = 0; i < NQ; ++i)
    h[i] = hadd(hadd(a[i][0], a[i][1]), hadd(a[i][2], a[i][3]));
}

// The 8 sums of keys j8..j8+7 from their two dot4 halves.
inline vf sums8(vf lo, vf hi) {
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
      __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

// acc[d:d+8*V] of each query = acc * corr + sum_j p[j] * v[j][d:d+8*V] (+ bias[i], a quantized
// block's sum_j p_j b_j), rows j in [j0, j1) in order: per output float the same multiply and
// fused multiply-adds whatever NQ and V.
// Out of line where a vector register file has 16 registers (the AVX2 and generic builds): inlined
// into attend_tile<3>, its 12 accumulators and 3 weights met what the scores and the exponentials
// left live there, and GCC kept two accumulators on the stack, a store and a load in each one's
// chain at every key. bench/harness/attend_fork.cpp mode 5 (8 forked rows over 1064 tokens, blocks
// from L1, one thread pinned), AMD Zen 3 VM, 2026-11-27, the AVX2 build: 4.41-4.50 -> 3.40-3.94 ms
// (the generic build, 16 registers too, follows it unmeasured). The same bits.
#undef PA_ACC_INLINE // this file is included once per build, and a harness may include two builds
#ifdef PA_ZMM
#define PA_ACC_INLINE inline
#else
#define PA_ACC_INLINE [[gnu::noinline]]
#endif
template <int NQ, int V, class Src>
PA_ACC_INLINE void accumulate_tile(const QRef* qs, int d, const float* corr, const float* p, const Src& v, int j0,
                                   int j1, const float* bias) {
  vf c[NQ][V];
  for (int i = 0; i < NQ; ++i) {
    const vf cv = splat(corr[i]);
    for (int k = 0; k < V; ++k)
      c[i][k] = load(qs[i].acc + d + 8 * k) * cv;
  }
  for (int j = j0; j < j1; ++j) {
    vf pj[NQ];
    for (int i = 0; i < NQ; ++i)
      pj[i] = splat(p[i * kMaxBlock + j]);
    for (int k = 0; k < V; ++k) {
      const vf x = v.at(j, d + 8 * k);
      for (int i = 0; i < NQ; ++i)
        c[i][k] += pj[i] * x;
    }
  }
  if (bias != nullptr)
    for (int i = 0; i < NQ; ++i)
      for (int k = 0; k < V; ++k)
        c[i][k] += splat(bias[i]);
  for (int i = 0; i < NQ; ++i)
    for (int k = 0; k < V; ++k)
      store(qs[i].acc + d + 8 * k, c[i][k]);
}

// acc over the value elements [d0, d1), NV vectors a pass, then one at a time.
template <int NQ, class Src>
inline void accumulate_span(const QRef* qs, int d0, int d1, const float* corr, const float* p, const Src& v,
                            int j0, int j1, const float* bias, PrefetchQueue& pq) {
  int d = d0;
  for (; d + 8 * NV <= d1; d += 8 * NV) {
    accumulate_tile<NQ, NV>(qs, d, corr, p, v, j0, j1, bias);
    pq.issue();
  }
  for (; d < d1; d += 8)
    accumulate_tile<NQ, 1>(qs, d, corr, p, v, j0, j1, bias);
}

// NQ queries that see the same keys [jl, jh) of one block (k, v: its key and value rows; af: a
// quantized block's scales and biases, else null): scores, the online-softmax update of each
// query's (m, l), then acc. Every query's arithmetic is what it is alone: a query's bits
// depend on no other query of its tile, so tiling queries (a row's heads, the rows that share
// a block, a chunk's tokens) changes no bit, nor does reading a quantized block's integers
// from its packed rows or from a float copy of them. s, p: NQ rows of kMaxBlock floats.
template <int NQ, class KSrc, class VSrc>
inline void attend_tile(const QRef* qs, const KSrc& k, const VSrc& v, const BlockAffine* af, int Dk, int Dv,
                        float* s, float* p, PrefetchQueue& pq) {
  const int jl = qs[0].jl, jh = qs[0].jh;
  const int ja = jl & ~7, jb = (jh + 7) & ~7; // 8-aligned, inside the block
  vf mb[NQ];
  for (int i = 0; i < NQ; ++i)
    mb[i] = splat(kNegInf);
  for (int j8 = ja; j8 < jb; j8 += 8) {
    vf sc[NQ];
    vf lo[NQ], hi[NQ];
    if (af == nullptr) {
      dot4<NQ>(qs, k, j8, 0, Dk, lo);
      dot4<NQ>(qs, k, j8 + 4, 0, Dk, hi);
      for (int i = 0; i < NQ; ++i)
        sc[i] = sums8(lo[i], hi[i]);
    } else {
      for (int i = 0; i < NQ; ++i)
        sc[i] = splat(0.0f);
      for (int g = 0; g < af->ngk; ++g) {
        dot4<NQ>(qs, k, j8, g * af->group, (g + 1) * af->group, lo);
        dot4<NQ>(qs, k, j8 + 4, g * af->group, (g + 1) * af->group, hi);
        const vf sg = load(af->ks + g * af->ld + j8), bg = load(af->kb + g * af->ld + j8);
        for (int i = 0; i < NQ; ++i)
          sc[i] = sc[i] + sums8(lo[i], hi[i]) * sg + bg * splat(qs[i].qsum[g]);
      }
    }
    const bool edge = j8 < jl || j8 + 8 > jh;
    const vi lane = vi{0, 1, 2, 3, 4, 5, 6, 7} + j8;
    const vi keep = (lane >= jl) & (lane < jh);
    for (int i = 0; i < NQ; ++i) {
      if (edge)
        sc[i] = select(keep, sc[i], splat(kNegInf));
      store(s + i * kMaxBlock + j8, sc[i]);
      mb[i] = vmax(mb[i], sc[i]);
    }
    pq.issue();
  }
  float corr[NQ];
  for (int i = 0; i < NQ; ++i) {
    float* m = qs[i].m;
    float* l = qs[i].l;
    const float mblk = hmax(mb[i]);
    const float mnew = *m > mblk ? *m : mblk;
    corr[i] = std::exp(*m - mnew); // 0 when m was -inf
    vf lsum = splat(0.0f);
    const vf mv = splat(mnew);
    for (int j8 = ja; j8 < jb; j8 += 8) {
      const vf e = vexp(load(s + i * kMaxBlock + j8) - mv);
      store(p + i * kMaxBlock + j8, e);
      lsum += e;
    }
    *l = *l * corr[i] + hsum(lsum);
    *m = mnew;
  }
  if (af == nullptr) {
    accumulate_span<NQ>(qs, 0, Dv, corr, p, v, jl, jh, nullptr, pq);
    return;
  }
  // Per value group: the weights p_j * s_j (s, free again, holds them) and sum_j p_j b_j.
  for (int g = 0; g < af->ngv; ++g) {
    const float* sg = af->vs + g * af->ld;
    const float* bg = af->vb + g * af->ld;
    float bsum[NQ];
    for (int i = 0; i < NQ; ++i) {
      vf bs = splat(0.0f);
      for (int j8 = ja; j8 < jb; j8 += 8) {
        const vf pv = load(p + i * kMaxBlock + j8);
        store(s + i * kMaxBlock + j8, pv * load(sg + j8));
        bs += pv * load(bg + j8);
      }
      bsum[i] = hsum(bs);
    }
    accumulate_span<NQ>(qs, g * af->group, (g + 1) * af->group, corr, s, v, jl, jh, bsum, pq);
  }
}

#ifdef PA_ZMM
// Pairs of queries in 16-lane registers (AVX-512F): the low 8 lanes carry one query's 8-lane
// arithmetic and the high 8 lanes the other's, each lane the very operations (the same fused
// multiply-adds from 0, the same horizontal tree) that the 8-lane loop gives it, so a query's
// bits stay what they are in any tile, in any build. Each key row is loaded once into both
// halves (a 256-bit broadcast, a load and no shuffle) and serves a pair per instruction: twice
// the multiply-adds per instruction, on the cores' two 512-bit FMA units. The value side needs
// no pairing: an output float's sum sees no other lane, so 16 of a query's outputs go at once.
// Attention alone (bench/harness/attend_fork.cpp), 8 layers, one thread, alternating with the
// 4-query tiles, 2026-11-26: 8 forked rows over 1064 tokens 3.36-3.64 -> 2.36-2.55 ms, one row
// 1.15-1.24 -> 1.03-1.15 ms (its two heads are a pair).
constexpr int TP = PA_ZMM; // pairs per tile
using mlxq::pairs16::bcast8;

inline __m512 hadd16(__m512 a, __m512 b) { // hadd() in each 256-bit half
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// dot4 for NP pairs: h[p] holds dot4's h of the pair's first query (low half) and second (high).
template <int NP>
inline void dot4_pairs(const QRef* qs, const F32Rows& k, int j, int Dk, __m512* h) {
  __m512 a[NP][4];
  for (int i = 0; i < NP; ++i)
    for (int u = 0; u < 4; ++u)
      a[i][u] = _mm512_setzero_ps();
  const float* kr = k.p + (int64_t)j * k.ld;
  for (int d = 0; d < Dk; d += 8) {
    __m512 x[NP];
    for (int i = 0; i < NP; ++i)
      x[i] = _mm512_loadu_ps(qs[2 * i].q2 + 2 * d);
    for (int u = 0; u < 4; ++u) {
      const __m512 kv = bcast8(kr + u * k.ld + d);
      for (int i = 0; i < NP; ++i)
        a[i][u] = _mm512_fmadd_ps(x[i], kv, a[i][u]);
    }
  }
  for (int i = 0; i < NP; ++i)
    h[i] = hadd16(hadd16(a[i][0], a[i][1]), hadd16(a[i][2], a[i][3]));
}

// sums8 in each half.
inline __m512 sums8_pairs(__m512 lo, __m512 hi) {
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i i1 = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  return _mm512_add_ps(_mm512_permutex2var_ps(lo, i0, hi), _mm512_permutex2var_ps(lo, i1, hi));
}

// The pair layout of scores: a pair's 8-key chunk c at 16 * c, the first query's 8 floats then
// the second's. The weights go to a row per query (query i's key j at i * kMaxBlock + j), so that
// the accumulation's loads of them need no index arithmetic per key.
// accumulate_tile (no bias) with 16 of each query's outputs a register; p: the weights of
// qs[0..NQ), query i's at p + i * kMaxBlock.
template <int NQ, int V>
inline void accumulate_z(const QRef* qs, int d, const float* corr, const float* p, const F32Rows& v, int j0,
                         int j1) {
  __m512 c[NQ][V];
  for (int i = 0; i < NQ; ++i) {
    const __m512 cv = _mm512_set1_ps(corr[i]);
    for (int k = 0; k < V; ++k)
      c[i][k] = _mm512_mul_ps(_mm512_loadu_ps(qs[i].acc + d + 16 * k), cv);
  }
  const float* vr = v.p + (int64_t)j0 * v.ld + d;
  for (int j = j0; j < j1; ++j, vr += v.ld) {
    __m512 pj[NQ];
    for (int i = 0; i < NQ; ++i)
      pj[i] = _mm512_set1_ps(p[i * kMaxBlock + j]);
    for (int k = 0; k < V; ++k) {
      const __m512 x = _mm512_loadu_ps(vr + 16 * k);
      for (int i = 0; i < NQ; ++i)
        c[i][k] = _mm512_fmadd_ps(pj[i], x, c[i][k]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int k = 0; k < V; ++k)
      _mm512_storeu_ps(qs[i].acc + d + 16 * k, c[i][k]);
}

// The outputs of NQ (2 or 4) queries, Dv a multiple of 16: 64 floats a pass, then 16.
template <int NQ>
inline void accumulate_span_z(const QRef* qs, int Dv, const float* corr, const float* p, const F32Rows& v, int j0,
                              int j1, PrefetchQueue& pq) {
  int d = 0;
  for (; d + 64 <= Dv; d += 64) {
    accumulate_z<NQ, 4>(qs, d, corr, p, v, j0, j1);
    pq.issue();
  }
  for (; d < Dv; d += 16)
    accumulate_z<NQ, 1>(qs, d, corr, p, v, j0, j1);
}

typedef float vz __attribute__((vector_size(64)));
typedef int32_t vzi __attribute__((vector_size(64)));

// attend_tile for NP pairs of queries (qs[0..2 NP), pair i = qs[2i], qs[2i + 1]) that see the
// same keys of a float block: the same steps, per query the same bits; the scores, their
// exponentials and sums go a pair at a time (s: the pair layout, pair i at i * 2 * kMaxBlock; p: a
// row per query).
template <int NP>
inline void attend_pairs(const QRef* qs, const F32Rows& k, const F32Rows& v, int Dk, int Dv, float* s, float* p,
                         PrefetchQueue& pq) {
  constexpr int NQ = 2 * NP;
  const int jl = qs[0].jl, jh = qs[0].jh;
  const int ja = jl & ~7, jb = (jh + 7) & ~7;
  __m512 mb[NP];
  for (int i = 0; i < NP; ++i)
    mb[i] = _mm512_set1_ps(kNegInf);
  for (int j8 = ja; j8 < jb; j8 += 8) {
    __m512 lo[NP], hi[NP];
    dot4_pairs<NP>(qs, k, j8, Dk, lo);
    dot4_pairs<NP>(qs, k, j8 + 4, Dk, hi);
    const bool edge = j8 < jl || j8 + 8 > jh;
    const __m512i lane = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm512_set1_epi32(j8));
    const __mmask16 keep = _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(jl)) &
        _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(jh));
    for (int i = 0; i < NP; ++i) {
      __m512 z = sums8_pairs(lo[i], hi[i]);
      if (edge)
        z = _mm512_mask_blend_ps(keep, _mm512_set1_ps(kNegInf), z);
      _mm512_storeu_ps(s + i * 2 * kMaxBlock + (j8 >> 3) * 16, z);
      mb[i] = _mm512_max_ps(mb[i], z); // vmax: the first operand where it is greater, else the second
    }
    pq.issue();
  }
  // Each query's new max and correction, then the exponentials of every pair's scores 8 keys at
  // a time (the pairs' chains side by side, where a pair's whole row went before the next pair's),
  // each pair's sums in key order as before. With the weights a row per query (accumulate_z), one
  // block of 16 queries from L1 (bench/harness/attend_parts.cpp, pinned to a core, 2026-11-27):
  // 1.45 -> 1.38 us; 8 forked rows over 1064 tokens, 8 layers (attend_fork.cpp, one thread, pinned),
  // blocks from L1 1.82 -> 1.72 ms, from memory 2.24 -> 2.13 ms; one row unchanged.
  float corr[NQ], mnew[NQ];
  __m512 mv[NP], lsum[NP];
  for (int i = 0; i < NP; ++i) {
    for (int h = 0; h < 2; ++h) {
      const float m = *qs[2 * i + h].m;
      const float mblk = hmax((vf)mlxq::pairs16::half(mb[i], h));
      mnew[2 * i + h] = m > mblk ? m : mblk;
      corr[2 * i + h] = std::exp(m - mnew[2 * i + h]); // 0 when m was -inf
    }
    const float a = mnew[2 * i], b = mnew[2 * i + 1];
    mv[i] = (__m512)vz{a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b};
    lsum[i] = _mm512_setzero_ps();
  }
  for (int j8 = ja; j8 < jb; j8 += 8)
    for (int i = 0; i < NP; ++i) {
      vz x;
      std::memcpy(&x, s + i * 2 * kMaxBlock + (j8 >> 3) * 16, sizeof(x));
      const __m512 e = (__m512)vexp_t<vz, vzi>(x - (vz)mv[i]);
      _mm256_storeu_ps(p + 2 * i * kMaxBlock + j8, mlxq::pairs16::half(e, 0));
      _mm256_storeu_ps(p + (2 * i + 1) * kMaxBlock + j8, mlxq::pairs16::half(e, 1));
      lsum[i] = _mm512_add_ps(lsum[i], e);
    }
  for (int i = 0; i < NP; ++i)
    for (int h = 0; h < 2; ++h) {
      float* l = qs[2 * i + h].l;
      *l = *l * corr[2 * i + h] + hsum((vf)mlxq::pairs16::half(lsum[i], h));
      *qs[2 * i + h].m = mnew[2 * i + h];
    }
  int i = 0;
  for (; i + 4 <= NQ; i += 4)
    accumulate_span_z<4>(qs + i, Dv, corr + i, p + i * kMaxBlock, v, jl, jh, pq);
  if (i < NQ) // NQ is even
    accumulate_span_z<2>(qs + i, Dv, corr + i, p + i * kMaxBlock, v, jl, jh, pq);
}
#endif

// Lines per step of the arithmetic (see PrefetchQueue) so that a block that nq queries attend
// (rows rows of it read; TQ queries to a tile, or with paired: 2 * PA_ZMM) issues about `lines`
// lines, a block's worth.
inline int pace_for(int nq, int rows, int Dv, int lines, bool paired) {
  int steps = ((nq + TQ - 1) / TQ) * ((rows + 7) / 8 + Dv / (8 * NV));
#ifdef PA_ZMM
  if (paired) { // attend_pairs: per tile its score steps, then 64 outputs of 4 queries a step
    const int tile = std::min(nq, 2 * PA_ZMM);
    steps = ((nq + 2 * PA_ZMM - 1) / (2 * PA_ZMM)) * ((rows + 7) / 8 + ((tile + 3) / 4) * std::max(1, Dv / 64));
  }
#endif
  return std::max(4, (lines + steps - 1) / std::max(1, steps));
}

// Queries [0, n) of a block's list, consecutive ones with the same keys TQ to a tile.
template <class KSrc, class VSrc>
void attend_queries(const QRef* qs, int n, const KSrc& k, const VSrc& v, const BlockAffine* af, int Dk, int Dv,
                    float* s, float* p, PrefetchQueue& pq) {
  auto same_keys = [&](int x, int y) { return qs[x].jl == qs[y].jl && qs[x].jh == qs[y].jh; };
  // A query that starts a pair is left to the pairs (an odd G's last heads tile alone).
  bool paired = false;
#ifdef PA_ZMM
  paired = af == nullptr && std::is_same_v<KSrc, F32Rows> && std::is_same_v<VSrc, F32Rows>;
#endif
  for (int i = 0; i < n;) {
#ifdef PA_ZMM
    if constexpr (std::is_same_v<KSrc, F32Rows> && std::is_same_v<VSrc, F32Rows>) {
      // Pairs (a query with a pair buffer and the next one), TP to a tile, that see the same keys.
      int np = 0;
      while (paired && np < TP && i + 2 * np + 1 < n && qs[i + 2 * np].q2 != nullptr &&
             same_keys(i, i + 2 * np) && same_keys(i, i + 2 * np + 1))
        ++np;
      switch (np) {
        case 0: break;
#if PA_ZMM >= 4
        case 4: attend_pairs<4>(qs + i, k, v, Dk, Dv, s, p, pq); break;
        case 3: attend_pairs<3>(qs + i, k, v, Dk, Dv, s, p, pq); break;
#endif
        case 2: attend_pairs<2>(qs + i, k, v, Dk, Dv, s, p, pq); break;
        default: attend_pairs<1>(qs + i, k, v, Dk, Dv, s, p, pq); break;
      }
      if (np > 0) {
        i += 2 * np;
        continue;
      }
    }
#endif
    int e = i + 1;
    while (e < n && e - i < TQ && same_keys(i, e) && !(paired && qs[e].q2 != nullptr))
      ++e;
    switch (e - i) {
#if PA_TQ >= 4
      case 4: attend_tile<4>(qs + i, k, v, af, Dk, Dv, s, p, pq); break;
#endif
#if PA_TQ >= 3
      case 3: attend_tile<3>(qs + i, k, v, af, Dk, Dv, s, p, pq); break;
#endif
#if PA_TQ >= 2
      case 2: attend_tile<2>(qs + i, k, v, af, Dk, Dv, s, p, pq); break;
#endif
      default: attend_tile<1>(qs + i, k, v, af, Dk, Dv, s, p, pq); break;
    }
    i = e;
  }
}

// The sums of a query row over each group of `group` elements (8 lanes, then hsum).
inline void group_sums(const float* q, int D, int group, float* out) {
  for (int g = 0; g * group < D; ++g) {
    vf acc = splat(0.0f);
    for (int d = g * group; d < (g + 1) * group; d += 8)
      acc += load(q + d);
    out[g] = hsum(acc);
  }
}

} // namespace

int attend(const Args& a, int hk, const Member* rows, int nrows, float* scratch, const Next* next, int prefetched) {
  const int G = a.Hq / a.Hkv;
  const int N = a.N;
  const int GN = G * N;
  const int Dk = a.Dk, Dv = a.Dv, BS = a.block_size;
  const int64_t S = (int64_t)a.num_blocks * BS;
  const int esize = a.pool_type == PoolType::f32 ? 4 : 2;
  // Bytes of one pool row (a token of one head): packed when quantized.
  const int64_t krow = a.bits ? (int64_t)Dk * a.bits / 8 : (int64_t)Dk * esize;
  const int64_t vrow = a.bits ? (int64_t)Dv * a.bits / 8 : (int64_t)Dv * esize;
  const char* kbase = (const char*)a.k + (int64_t)hk * S * krow;
  const char* vbase = (const char*)a.v + (int64_t)hk * S * vrow;
  float* kconv = scratch;
  float* vconv = scratch + (int64_t)BS * Dk;
  if (nrows > kMaxMembers)
    nrows = kMaxMembers; // the plan makes no larger task (the arrays below hold kMaxMembers)

  int lo[kMaxMembers], hi[kMaxMembers];
  int T0 = 0, T1 = 0;
  for (int r = 0; r < nrows; ++r) {
    const Member& mr = rows[r];
    for (int i = 0; i < GN; ++i) {
      mr.m[i] = kNegInf;
      mr.l[i] = 0.0f;
    }
    std::memset(mr.acc, 0, sizeof(float) * (size_t)GN * Dv);
    row_key_range(a, mr.b, lo[r], hi[r]);
    if (r == 0 || mr.t0 < T0)
      T0 = mr.t0;
    if (r == 0 || mr.t1 > T1)
      T1 = mr.t1;
  }

  alignas(64) float s[kTileRows * kMaxBlock];
  alignas(64) float p[kTileRows * kMaxBlock];
  thread_local std::vector<QRef> qs;
  qs.resize((size_t)nrows * GN);
  // Float pools on PA_ZMM builds: each token's heads in pairs (g, g + 1), their rows interleaved
  // 8 floats at a time (attend_pairs), once per task; an odd G's last head goes alone.
  thread_local std::vector<float> qpairs;
#ifdef PA_ZMM
  const bool pairs = !a.bits && G >= 2 && Dv % 16 == 0;
  if (pairs) {
    qpairs.resize((size_t)nrows * GN * Dk);
    for (int r = 0; r < nrows; ++r)
      for (int n = 0; n < N; ++n)
        for (int g = 0; g + 1 < G; g += 2) {
          const float* qa = rows[r].q + (int64_t)(g * N + n) * Dk;
          mlxq::pairs16::interleave8(qa, qa + (int64_t)N * Dk, Dk, qpairs.data() + ((int64_t)(r * N + n) * G + g) * Dk);
        }
  }
#else
  const bool pairs = false;
#endif
  // Quantized pools: each query's sums over the key groups, and a block's scales and biases
  // as fp32 rows per group (read in place when they are fp32 with one group a row).
  const int ngk = a.bits ? Dk / a.group : 0, ngv = a.bits ? Dv / a.group : 0;
  thread_local std::vector<float> qsums, affine;
  if (a.bits) {
    qsums.resize((size_t)nrows * GN * ngk);
    for (int r = 0; r < nrows; ++r)
      for (int i = 0; i < GN; ++i)
        group_sums(rows[r].q + (int64_t)i * Dk, Dk, a.group, qsums.data() + ((int64_t)r * GN + i) * ngk);
    affine.resize((size_t)2 * (ngk + ngv) * kMaxBlock);
  }
  // Each member's queries as a block's list holds them (its tokens in order, each token's G heads
  // together), once per task: what no block changes (the rows' pointers), and per token the keys
  // it may see in the row's positions (causal, length, window); a block sets jl and jh. (Built at
  // every block, the list was ~60% of this function's own time, which was ~14% of the attention's
  // with the blocks in L1. bench/harness/attend_fork.cpp mode 4, pinned, 2026-11-27: 8 forked rows
  // over 1064 tokens 1.80 -> 1.72 ms, one row 0.61 -> 0.59 ms.)
  thread_local std::vector<QRef> qtmpl;
  thread_local std::vector<int64_t> qspan; // per member and token: [lowest key, one past the last)
  qtmpl.resize((size_t)nrows * GN);
  qspan.resize((size_t)nrows * N * 2);
  for (int r = 0; r < nrows; ++r) {
    const Member& mr = rows[r];
    const int64_t off = a.q_off[mr.b];
    const int64_t kvl = a.kv_len[mr.b];
    for (int n = 0; n < N; ++n) {
      const int64_t pos = off + n;
      qspan[((size_t)r * N + n) * 2] = a.window > 0 ? pos - a.window + 1 : 0;
      qspan[((size_t)r * N + n) * 2 + 1] = pos + 1 < kvl ? pos + 1 : kvl;
      for (int g = 0; g < G; ++g) {
        const int i = g * N + n;
        const float* qsum = a.bits ? qsums.data() + ((int64_t)r * GN + i) * ngk : nullptr;
        const float* q2 =
            pairs && g % 2 == 0 && g + 1 < G ? qpairs.data() + ((int64_t)(r * N + n) * G + g) * Dk : nullptr;
        qtmpl[(size_t)r * GN + (size_t)n * G + g] = {mr.q + (int64_t)i * Dk, mr.m + i, mr.l + i,
                                                      mr.acc + (int64_t)i * Dv, 0, 0, qsum, q2};
      }
    }
  }
  // the thread_local arrays' addresses, looked up once (not at every block)
  QRef* const qs0 = qs.data();
  const QRef* const tmpl0 = qtmpl.data();
  const int64_t* const span0 = qspan.data();
  auto block_affine = [&](int64_t row0, int c0, int c1) {
    BlockAffine af{nullptr, nullptr, nullptr, nullptr, kMaxBlock, a.group, ngk, ngv};
    if (a.pool_type == PoolType::f32 && ngk == 1 && ngv == 1) {
      af.ks = (const float*)a.ks + row0;
      af.kb = (const float*)a.kb + row0;
      af.vs = (const float*)a.vs + row0;
      af.vb = (const float*)a.vb + row0;
      return af;
    }
    float* buf = affine.data();
    const void* src[4] = {a.ks, a.kb, a.vs, a.vb};
    const int ng[4] = {ngk, ngk, ngv, ngv};
    const float** dst[4] = {&af.ks, &af.kb, &af.vs, &af.vb};
    for (int x = 0; x < 4; ++x) {
      for (int g = 0; g < ng[x]; ++g)
        for (int j = c0; j < c1; ++j)
          buf[g * kMaxBlock + j] = load_float(a.pool_type, src[x], (row0 + j) * ng[x] + g);
      *dst[x] = buf;
      buf += ng[x] * kMaxBlock;
    }
    return af;
  };
  int32_t fetched[kPrefetchAhead + 1]; // the last blocks prefetched (rows that share them ask again)
  for (int32_t& f : fetched)
    f = -1;
  int nfetched = 0;
  PrefetchQueue pq;
  // pool block blk, read at block t of the task
  // pool block blk of kv head h (its K and V rows), read at block t
  auto push_block = [&](int h, int32_t blk, int t) {
    pq.push((const char*)a.k + ((int64_t)h * S + (int64_t)blk * BS) * krow, (int64_t)BS * krow, t);
    pq.push((const char*)a.v + ((int64_t)h * S + (int64_t)blk * BS) * vrow, (int64_t)BS * vrow, t);
  };
  auto prefetch_block = [&](int32_t blk, int t) {
    if (blk < 0 || blk >= a.num_blocks)
      return;
    for (int32_t f : fetched)
      if (f == blk)
        return;
    push_block(hk, blk, t);
    fetched[nfetched++ % (kPrefetchAhead + 1)] = blk;
  };
  // block v of the next task (its members' t0 + v), read after this task's last block (t)
  const int nnext = next != nullptr ? std::min(next->nrows, kMaxMembers) : 0;
  auto prefetch_next = [&](int v, int t) {
    int32_t seen[kMaxMembers];
    int nseen = 0;
    for (int r = 0; r < nnext; ++r) {
      const Member& nr = next->rows[r];
      if (nr.t0 + v >= nr.t1)
        continue;
      const int32_t blk = a.tables[(int64_t)nr.b * a.nb + nr.t0 + v];
      if (blk < 0 || blk >= a.num_blocks || std::find(seen, seen + nseen, blk) != seen + nseen)
        continue;
      seen[nseen++] = blk;
      push_block(next->hk, blk, t);
    }
  };
  int blk_of[kMaxMembers], j0_of[kMaxMembers], j1_of[kMaxMembers];

  for (int t = T0; t < T1; ++t) {
    const int64_t start = (int64_t)t * BS;
    // Which pool block each member reads at t (-1: none), and which of its rows.
    for (int r = 0; r < nrows; ++r) {
      const Member& mr = rows[r];
      blk_of[r] = -1;
      if (t < mr.t0 || t >= mr.t1)
        continue;
      const int j0 = (int)((lo[r] > start ? lo[r] : start) - start);
      const int j1 = (int)((hi[r] < start + BS ? hi[r] : start + BS) - start);
      if (j1 <= j0)
        continue;
      const int32_t* table = a.tables + (int64_t)mr.b * a.nb;
      const int32_t blk = table[t];
      if (blk < 0 || blk >= a.num_blocks)
        continue; // never read outside the pool
      blk_of[r] = blk;
      j0_of[r] = j0;
      j1_of[r] = j1;
    }
    // kPrefetchAhead blocks ahead; at a member's first block, that block and the ones up to
    // there too; nearest first, so that the queue holds them in the order they are read
    for (int u = 0; u <= kPrefetchAhead; ++u)
      for (int r = 0; r < nrows; ++r) {
        const Member& mr = rows[r];
        if (blk_of[r] >= 0 && (u == kPrefetchAhead || t == mr.t0) && t + u < mr.t1 && t + u - T0 >= prefetched)
          prefetch_block(a.tables[(int64_t)mr.b * a.nb + t + u], t + u);
      }
    // past this task's last block: the next task's first ones, as if they were this task's
    for (int u = 0; u <= kPrefetchAhead && nnext > 0; ++u)
      if ((u == kPrefetchAhead || t == T0) && t + u >= T1 && t + u - T1 < kPrefetchAhead)
        prefetch_next(t + u - T1, t + u);
    pq.issue_upto(t + 1); // this block's and the next one's lines not issued yet go out now
    // Each pool block once: the members on it attend it together.
    for (int r = 0; r < nrows; ++r) {
      const int32_t blk = blk_of[r];
      if (blk < 0)
        continue;
      // The 8-aligned span of rows any of them reads (dot4 reads whole groups of 8 rows).
      int c0 = BS, c1 = 0;
      for (int u = r; u < nrows; ++u)
        if (blk_of[u] == blk) {
          c0 = std::min(c0, j0_of[u] & ~7);
          c1 = std::max(c1, (j1_of[u] + 7) & ~7);
        }
      const char* kb_raw = kbase + (int64_t)blk * BS * krow;
      const char* vb_raw = vbase + (int64_t)blk * BS * vrow;
      // The queries of these members, each with the keys of the block it may see (causal,
      // length, window), a member's tokens in order and each token's G heads together.
      int nq = 0;
      for (int u = r; u < nrows; ++u) {
        if (blk_of[u] != blk)
          continue;
        blk_of[u] = -1; // done at t
        const int64_t* span = span0 + (size_t)u * N * 2;
        const QRef* tq = tmpl0 + (size_t)u * GN;
        for (int n = 0; n < N; ++n, span += 2, tq += G) {
          const int jl = (int)((span[0] - start) > j0_of[u] ? (span[0] - start) : j0_of[u]);
          const int jh = (int)((span[1] - start) < j1_of[u] ? (span[1] - start) : j1_of[u]);
          if (jh <= jl)
            continue;
          for (int g = 0; g < G; ++g) {
            QRef& x = qs0[nq++];
            x = tq[g];
            x.jl = jl;
            x.jh = jh;
          }
        }
      }
      pq.pace(pace_for(nq, c1 - c0, Dv, (int)((int64_t)BS * (krow + vrow) / 64), pairs));
      if (a.pool_type == PoolType::f32 && !a.bits) {
        attend_queries(qs0, nq, F32Rows{(const float*)kb_raw, Dk}, F32Rows{(const float*)vb_raw, Dv}, nullptr,
                       Dk, Dv, s, p, pq);
      } else if (!a.bits) {
        convert_rows(a.pool_type, (const uint16_t*)kb_raw, kconv, Dk, c0, c1);
        convert_rows(a.pool_type, (const uint16_t*)vb_raw, vconv, Dv, c0, c1);
        attend_queries(qs0, nq, F32Rows{kconv, Dk}, F32Rows{vconv, Dv}, nullptr, Dk, Dv, s, p, pq);
      } else {
        const BlockAffine af = block_affine((int64_t)hk * S + (int64_t)blk * BS, c0, c1);
        // Several tiles: the integers once, as floats (the same bits as from the packed rows).
        auto attend_packed = [&](const auto& k, const auto& v) {
          if (nq > TQ) {
            unpack_rows(k, kconv, Dk, c0, c1);
            unpack_rows(v, vconv, Dv, c0, c1);
            attend_queries(qs0, nq, F32Rows{kconv, Dk}, F32Rows{vconv, Dv}, &af, Dk, Dv, s, p, pq);
          } else {
            attend_queries(qs0, nq, k, v, &af, Dk, Dv, s, p, pq);
          }
        };
        if (a.bits == 8)
          attend_packed(U8Rows{(const uint8_t*)kb_raw, krow}, U8Rows{(const uint8_t*)vb_raw, vrow});
        else
          attend_packed(U4Rows{(const uint32_t*)kb_raw, krow / 4}, U4Rows{(const uint32_t*)vb_raw, vrow / 4});
      }
    }
  }
  pq.issue_upto(T1 + kPrefetchAhead); // the next task's lines still queued go out now
  return nnext > 0 && T1 > T0 ? kPrefetchAhead : 0;
}

namespace {

// Lanes [i, i + n) of x (n <= 8), the missing lanes -inf (probability 0).
inline vf load_tail(const float* x, int64_t n) {
  vf v = splat(kNegInf);
  for (int64_t j = 0; j < n; ++j)
    v[j] = x[j];
  return v;
}

inline vf chunk_exp(const float* x, int64_t i, int64_t V, vf m, vf t) {
  const vf v = i + 8 <= V ? load(x + i) : load_tail(x + i, V - i);
  return vexp((v - m) * t);
}

} // namespace

int64_t categorical(const float* x, int64_t V, float inv_temp, float u, float* chunks) {
  if (V <= 0)
    return 0;
  vf mv = splat(kNegInf);
  for (int64_t i = 0; i < V; i += 8)
    mv = vmax(mv, i + 8 <= V ? load(x + i) : load_tail(x + i, V - i));
  const float m = hmax(mv);
  if (!(m > kNegInf) || !(m < std::numeric_limits<float>::infinity()))
    return 0; // nothing finite to draw from
  const vf mvec = splat(m), tv = splat(inv_temp);
  const int64_t nc = (V + 7) / 8;
  double total = 0.0;
  for (int64_t c = 0; c < nc; ++c) {
    chunks[c] = hsum(chunk_exp(x, 8 * c, V, mvec, tv));
    total += chunks[c];
  }
  const double thr = (double)u * total;
  double cum = 0.0;
  for (int64_t c = 0; c < nc; ++c) {
    if (cum + chunks[c] <= thr) {
      cum += chunks[c];
      continue;
    }
    const vf e = chunk_exp(x, 8 * c, V, mvec, tv);
    int64_t last = -1;
    for (int j = 0; j < 8 && 8 * c + j < V; ++j) {
      if (e[j] > 0.0f)
        last = 8 * c + j;
      cum += e[j];
      if (cum > thr && e[j] > 0.0f)
        return 8 * c + j;
    }
    if (last >= 0)
      return last; // the lanes' own sum fell short of the chunk's by rounding
  }
  for (int64_t c = nc - 1; c >= 0; --c) { // u * total rounded up to total: the last drawable index
    if (chunks[c] > 0.0f) {
      const vf e = chunk_exp(x, 8 * c, V, mvec, tv);
      for (int j = 7; j >= 0; --j)
        if (8 * c + j < V && e[j] > 0.0f)
          return 8 * c + j;
    }
  }
  return 0;
}

int64_t argmax(const float* x, int64_t V) {
  // Per lane: its largest value above -inf and the first index holding it (a lane sees its
  // indices in increasing order, and only a strictly larger value moves it); then the best lane,
  // the smallest index among equal values; then the tail, which comes after every lane's index.
  float m = kNegInf;
  int64_t at = -1;
  int64_t i = 0;
  if (V >= 8 && V < ((int64_t)1 << 31) - 8) {
    vf best = splat(kNegInf);
    vi where = splat_i(-1);
    vi idx = vi{0, 1, 2, 3, 4, 5, 6, 7};
    for (; i + 8 <= V; i += 8) {
      const vf v = load(x + i);
      const vi up = v > best;
      best = select(up, v, best);
      where = (where & ~up) | (idx & up);
      idx += splat_i(8);
    }
    for (int j = 0; j < 8; ++j) {
      if (where[j] < 0)
        continue;
      if (best[j] > m || (best[j] == m && where[j] < at)) {
        m = best[j];
        at = where[j];
      }
    }
  }
  for (; i < V; ++i)
    if (x[i] > m) {
      m = x[i];
      at = i;
    }
  if (at >= 0)
    return at;
  for (int64_t j = 0; j < V; ++j) // nothing above -inf: the first -inf (0 when all are NaN)
    if (x[j] == kNegInf)
      return j;
  return 0;
}

} // namespace PA_NS
} // namespace mlxq_pa
