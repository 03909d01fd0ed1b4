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
#include <vector>

#include "pa_kernel.h"

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

inline vf select(vi mask, vf a, vf b) {
  return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

// exp(x) for x <= 0 (Cephes' expf polynomial, ~1 ulp); exactly 0 below -87.3
// (so -inf gives 0, which masked keys rely on).
inline vf vexp(vf x) {
  const vf lo = splat(-87.3f);
  const vi dead = x < lo;
  x = select(dead, lo, x);
  x = select(x > splat(0.0f), splat(0.0f), x);
  vf fx = x * splat(1.44269504088896341f) + splat(0.5f);
  vi ti = __builtin_convertvector(fx, vi); // toward zero
  vf tf = __builtin_convertvector(ti, vf);
  ti = ti + (vi)(tf > fx); // floor: -1 where truncation went up
  tf = __builtin_convertvector(ti, vf);
  x = x - tf * splat(0.693359375f) - tf * splat(-2.12194440e-4f);
  const vf z = x * x;
  vf y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * z + x + splat(1.0f);
  const vi e = (ti + 127) << 23;
  y = y * (vf)e;
  return (vf)((vi)y & ~dead);
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

// mx.quantize puts element e of a packed row in bits (e * bits) % 32 of uint32
// word (e * bits) / 32. Each helper dequantizes 32 consecutive elements
// (x = q * s + b) from the words at w into out.
inline void dequant32_4bit(const uint32_t* w, vf s, vf b, float* out) {
  const vi shifts = {0, 4, 8, 12, 16, 20, 24, 28};
  for (int k = 0; k < 4; ++k) {
    const int32_t x = (int32_t)w[k];
    const vi q = (vi{x, x, x, x, x, x, x, x} >> shifts) & 15;
    store(out + 8 * k, __builtin_convertvector(q, vf) * s + b);
  }
}

inline void dequant32_8bit(const uint32_t* w, vf s, vf b, float* out) {
#ifdef __AVX2__
  // Element e is bits (e * 8) % 32 of word e / 4: byte e of the row (x86 is
  // little-endian), so 8 bytes widen to 8 ints in one vpmovzxbd.
  const __m128i* bytes = (const __m128i*)w;
  for (int k = 0; k < 4; ++k) {
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)((const char*)bytes + 8 * k)));
    store(out + 8 * k, (vf)_mm256_cvtepi32_ps(q) * s + b);
  }
#else
  vi W;
  std::memcpy(&W, w, sizeof(W)); // 8 words: 32 elements
  const vi shifts = {0, 8, 16, 24, 0, 8, 16, 24};
  // one permute per 8 elements (words 2k, 2k + 1, each 4 times), then shift/mask
  const vi q0 = (__builtin_shufflevector(W, W, 0, 0, 0, 0, 1, 1, 1, 1) >> shifts) & 255;
  const vi q1 = (__builtin_shufflevector(W, W, 2, 2, 2, 2, 3, 3, 3, 3) >> shifts) & 255;
  const vi q2 = (__builtin_shufflevector(W, W, 4, 4, 4, 4, 5, 5, 5, 5) >> shifts) & 255;
  const vi q3 = (__builtin_shufflevector(W, W, 6, 6, 6, 6, 7, 7, 7, 7) >> shifts) & 255;
  store(out, __builtin_convertvector(q0, vf) * s + b);
  store(out + 8, __builtin_convertvector(q1, vf) * s + b);
  store(out + 16, __builtin_convertvector(q2, vf) * s + b);
  store(out + 24, __builtin_convertvector(q3, vf) * s + b);
#endif
}

// Rows [j0, j1) of one block of a quantized pool, dequantized to fp32 rows in
// dst. src: the block's packed rows; sc/bi: the pool's scales/biases (D / group
// per row), row0 the block's first row there. Groups are multiples of 32.
void dequant_rows(
    const Args& a,
    const uint32_t* src,
    const void* sc,
    const void* bi,
    int64_t row0,
    float* dst,
    int D,
    int j0,
    int j1) {
  const int words = D * a.bits / 32, ng = D / a.group, wpc = a.bits; // words per 32 elements
  for (int j = j0; j < j1; ++j) {
    const uint32_t* w = src + (int64_t)j * words;
    float* out = dst + (int64_t)j * D;
    for (int g = 0; g < ng; ++g) {
      const int64_t si = (row0 + j) * ng + g;
      const vf s = splat(load_float(a.pool_type, sc, si));
      const vf b = splat(load_float(a.pool_type, bi, si));
      for (int e = g * a.group; e < (g + 1) * a.group; e += 32) {
        if (a.bits == 4)
          dequant32_4bit(w + e / 32 * wpc, s, b, out + e);
        else
          dequant32_8bit(w + e / 32 * wpc, s, b, out + e);
      }
    }
  }
}

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

// One query of a block: its row of the group (fp32, scaled), its (m, l, acc), and the
// keys [jl, jh) of the block it may see.
struct QRef {
  const float* q;
  float* m;
  float* l;
  float* acc;
  int jl, jh;
};

// Lane partials of NQ queries against 4 consecutive key rows: lane l of key j sums
// q[d] * k_j[d] over d = l, l + 8, ... in order (fused multiply-adds from 0), then
// h[i] = [lo0..lo3, hi0..hi3] of query i with lo = (l0 + l1) + (l2 + l3) and hi =
// (l4 + l5) + (l6 + l7); the score is lo + hi (attend_tile). A query's sums do not
// depend on NQ.
template <int NQ>
inline void dot4(const QRef* qs, const float* k, int D, vf* h) {
  vf a[NQ][4];
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < 4; ++j)
      a[i][j] = splat(0.0f);
  const float* k1 = k + D;
  const float* k2 = k + 2 * D;
  const float* k3 = k + 3 * D;
  for (int d = 0; d < D; d += 8) {
    vf x[NQ];
    for (int i = 0; i < NQ; ++i)
      x[i] = load(qs[i].q + d);
    vf kv = load(k + d);
    for (int i = 0; i < NQ; ++i)
      a[i][0] += x[i] * kv;
    kv = load(k1 + d);
    for (int i = 0; i < NQ; ++i)
      a[i][1] += x[i] * kv;
    kv = load(k2 + d);
    for (int i = 0; i < NQ; ++i)
      a[i][2] += x[i] * kv;
    kv = load(k3 + d);
    for (int i = 0; i < NQ; ++i)
      a[i][3] += x[i] * kv;
  }
  for (int i = 0; i < NQ; ++i)
    h[i] = hadd(hadd(a[i][0], a[i][1]), hadd(a[i][2], a[i][3]));
}

// acc[d:d+8*V] of each query = acc * corr + sum_j p[j] * v[j][d:d+8*V], rows j in [j0, j1)
// in order: per output float the same multiply and fused multiply-adds whatever NQ and V.
template <int NQ, int V>
inline void accumulate_tile(const QRef* qs, int d, const float* corr, const float* p, const float* v,
                            int ldv, int j0, int j1) {
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
    const float* row = v + (int64_t)j * ldv + d;
    for (int k = 0; k < V; ++k) {
      const vf x = load(row + 8 * k);
      for (int i = 0; i < NQ; ++i)
        c[i][k] += pj[i] * x;
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int k = 0; k < V; ++k)
      store(qs[i].acc + d + 8 * k, c[i][k]);
}

// NQ queries that see the same keys [jl, jh) of one block (kb / vb: its keys and values
// as fp32 rows): scores, the online-softmax update of each query's (m, l), then acc. Every
// query's arithmetic is what it is alone: a query's bits depend on no other query of its
// tile, so tiling queries (a row's heads, the rows that share a block, a chunk's tokens)
// changes no bit. s, p: NQ rows of kMaxBlock floats.
template <int NQ>
inline void attend_tile(const QRef* qs, const float* kb, const float* vb, int Dk, int Dv, float* s, float* p,
                        PrefetchQueue& pq) {
  const int jl = qs[0].jl, jh = qs[0].jh;
  const int ja = jl & ~7, jb = (jh + 7) & ~7; // 8-aligned, inside the block
  vf mb[NQ];
  for (int i = 0; i < NQ; ++i)
    mb[i] = splat(kNegInf);
  for (int j8 = ja; j8 < jb; j8 += 8) {
    vf lo[NQ], hi[NQ];
    dot4<NQ>(qs, kb + (int64_t)j8 * Dk, Dk, lo);
    dot4<NQ>(qs, kb + (int64_t)(j8 + 4) * Dk, Dk, hi);
    const bool edge = j8 < jl || j8 + 8 > jh;
    const vi lane = vi{0, 1, 2, 3, 4, 5, 6, 7} + j8;
    const vi keep = (lane >= jl) & (lane < jh);
    for (int i = 0; i < NQ; ++i) {
      vf sc = __builtin_shufflevector(lo[i], hi[i], 0, 1, 2, 3, 8, 9, 10, 11) +
          __builtin_shufflevector(lo[i], hi[i], 4, 5, 6, 7, 12, 13, 14, 15);
      if (edge)
        sc = select(keep, sc, splat(kNegInf));
      store(s + i * kMaxBlock + j8, sc);
      mb[i] = vmax(mb[i], sc);
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
  int d = 0;
  for (; d + 8 * NV <= Dv; d += 8 * NV) {
    accumulate_tile<NQ, NV>(qs, d, corr, p, vb, Dv, jl, jh);
    pq.issue();
  }
  for (; d < Dv; d += 8)
    accumulate_tile<NQ, 1>(qs, d, corr, p, vb, Dv, jl, jh);
}

// Lines per step of the arithmetic (see PrefetchQueue) so that a block that nq queries attend
// (rows rows of it read, TQ queries to a tile) issues about `lines` lines, a block's worth.
inline int pace_for(int nq, int rows, int Dv, int lines) {
  const int steps = ((nq + TQ - 1) / TQ) * ((rows + 7) / 8 + Dv / (8 * NV));
  return std::max(4, (lines + steps - 1) / std::max(1, steps));
}

// Queries [0, n) of a block's list, consecutive ones with the same keys TQ to a tile.
void attend_queries(const QRef* qs, int n, const float* kb, const float* vb, int Dk, int Dv, float* s,
                    float* p, PrefetchQueue& pq) {
  for (int i = 0; i < n;) {
    int e = i + 1;
    while (e < n && e - i < TQ && qs[e].jl == qs[i].jl && qs[e].jh == qs[i].jh)
      ++e;
    switch (e - i) {
#if PA_TQ >= 4
      case 4: attend_tile<4>(qs + i, kb, vb, Dk, Dv, s, p, pq); break;
#endif
#if PA_TQ >= 3
      case 3: attend_tile<3>(qs + i, kb, vb, Dk, Dv, s, p, pq); break;
#endif
#if PA_TQ >= 2
      case 2: attend_tile<2>(qs + i, kb, vb, Dk, Dv, s, p, pq); break;
#endif
      default: attend_tile<1>(qs + i, kb, vb, Dk, Dv, s, p, pq); break;
    }
    i = e;
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

  alignas(32) float s[TQ * kMaxBlock];
  alignas(32) float p[TQ * kMaxBlock];
  thread_local std::vector<QRef> qs;
  qs.resize((size_t)nrows * GN);
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
      const float* kb;
      const float* vb;
      if (a.pool_type == PoolType::f32 && !a.bits) {
        kb = (const float*)kb_raw;
        vb = (const float*)vb_raw;
      } else {
        if (a.bits) {
          const int64_t row0 = (int64_t)hk * S + (int64_t)blk * BS; // scales/biases row
          dequant_rows(a, (const uint32_t*)kb_raw, a.ks, a.kb, row0, kconv, Dk, c0, c1);
          dequant_rows(a, (const uint32_t*)vb_raw, a.vs, a.vb, row0, vconv, Dv, c0, c1);
        } else {
          convert_rows(a.pool_type, (const uint16_t*)kb_raw, kconv, Dk, c0, c1);
          convert_rows(a.pool_type, (const uint16_t*)vb_raw, vconv, Dv, c0, c1);
        }
        kb = kconv;
        vb = vconv;
      }
      // The queries of these members, each with the keys of the block it may see (causal,
      // length, window), a member's tokens in order and each token's G heads together.
      int nq = 0;
      for (int u = r; u < nrows; ++u) {
        if (blk_of[u] != blk)
          continue;
        blk_of[u] = -1; // done at t
        const Member& mr = rows[u];
        const int64_t off = a.q_off[mr.b];
        const int64_t kvl = a.kv_len[mr.b];
        for (int n = 0; n < N; ++n) {
          const int64_t pos = off + n;
          const int64_t qh = pos + 1 < kvl ? pos + 1 : kvl;
          const int64_t ql = a.window > 0 ? pos - a.window + 1 : 0;
          const int jl = (int)((ql - start) > j0_of[u] ? (ql - start) : j0_of[u]);
          const int jh = (int)((qh - start) < j1_of[u] ? (qh - start) : j1_of[u]);
          if (jh <= jl)
            continue;
          for (int g = 0; g < G; ++g) {
            const int i = g * N + n;
            qs[nq++] = {mr.q + (int64_t)i * Dk, mr.m + i, mr.l + i, mr.acc + (int64_t)i * Dv, jl, jh};
          }
        }
      }
      pq.pace(pace_for(nq, c1 - c0, Dv, (int)((int64_t)BS * (krow + vrow) / 64)));
      attend_queries(qs.data(), nq, kb, vb, Dk, Dv, s, p, pq);
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
