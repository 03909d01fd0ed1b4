// qdot_impl.h in AVX2 registers, for qdot_avx2.cpp and qdot_vnni.cpp (built -mavx2 -mfma -mf16c
// -ffp-contract=off; with QDOT_VNNI also -mavxvnni). A lane's integer is the same either way: AVX2 multiplies bytes into 16-bit pairs
// (maddubs) and adds pairs into 32 bits (madd), AVX-VNNI's dpbusd does both in one instruction.
// 8-bit weights go through maddubs as two nibbles (a whole byte times 127 twice would saturate
// its 16 bits); dpbusd takes the byte whole.
#pragma once

#include <immintrin.h>

#include "qdot.h"

#include <cstdint>

namespace mlxq::qdot::QDOT_NS {
namespace {
#include "lanes8_avx2.h"
using I = __m256i;
// generic's quantize_block in registers: max|x| exact in any order, x * inv and cvtps_epi32's
// rounding (to nearest, ties to even, as nearbyint) element by element, so the same bits.
inline void quantize_block(const float* xb, int bits, int b, int8_t* qc, float* step, int* total) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4];
  __m256 amax8 = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    x[k] = _mm256_loadu_ps(xb + 8 * k);
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, x[k]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  *step = amax / 127.0f;
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256i q[4];
  for (int k = 0; k < 4; ++k)
    q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(x[k], vinv));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *total = _mm_cvtsi128_si32(s4);
  // the 32 values as bytes in element order (|v| <= 127: the packs never saturate)
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  const __m256i v = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (bits != 4) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qc + b * kBlock), v);
    return;
  }
  // evens then odds within each 16 bytes, then the two halves' evens together and their odds
  const __m256i split = _mm256_shuffle_epi8(
      v, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7,
                          9, 11, 13, 15));
  const __m256i eo = _mm256_permute4x64_epi64(split, 0xd8); // qwords 0 2 1 3
  int8_t* base = qc + 64 * (b / 2) + 16 * (b % 2);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(base), _mm256_castsi256_si128(eo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(base + 32), _mm256_extracti128_si256(eo, 1));
}
inline V vcvt(I x) { return _mm256_cvtepi32_ps(x); }
// The first n (1 to 8) 16-bit values at p, the rest zero, reading no byte past them (a row's last
// chunk may end the array): whole pairs by a masked load, an odd last one blended in.
inline __m128i load_u16s(const uint16_t* p, int n) {
  if (n == 8)
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i r = _mm_maskload_epi32(reinterpret_cast<const int*>(p),
                                 _mm_cmpgt_epi32(_mm_set1_epi32(n / 2), _mm_setr_epi32(0, 1, 2, 3)));
  if (n % 2)
    r = _mm_blendv_epi8(r, _mm_set1_epi16((short)p[n - 1]),
                        _mm_cmpeq_epi16(_mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7), _mm_set1_epi16((short)(n - 1))));
  return r;
}
// The first n (1 to 8) scales or biases of kind KIND at p as float32 (widened exactly: F16C's
// vcvtph2ps, a bf16 shifted into a float32's high half), the rest zero.
template <ScaleKind KIND>
inline V load_scales(const ScaleT<KIND>* p, int n) {
  if constexpr (KIND == ScaleKind::f32) {
    return n == 8 ? _mm256_loadu_ps(p)
                  : _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  } else if constexpr (KIND == ScaleKind::f16) {
    return _mm256_cvtph_ps(load_u16s(p, n));
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load_u16s(p, n)), 16));
  }
}
// The chunk's entries in one load, then one permute puts each lane's block's entry in place. Not a
// gather through a buffer on the stack: the vector load of that buffer waits for its small stores,
// which made a row's short last chunk cost more than a whole one.
template <int BITS, ScaleKind KIND>
inline V chunk_of(const ScaleT<KIND>* row, int c, int per, int nb) {
  const __m256i blocks = BITS == 4 ? _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7) : _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // nb is a multiple of per (K is of the group size), so a lane past the chunk's blocks reads an
  // entry past the nb / per loaded: a zero
  const V v = load_scales<KIND>(row + 8 * c / per, nb / per);
  if (BITS == 8 && per == 1)
    return v;
  return _mm256_permutevar8x32_ps(v, _mm256_srl_epi32(blocks, _mm_cvtsi32_si128(__builtin_ctz(per))));
}
// A chunk's weights as 8 registers: 4 bits, for each pair of blocks their low nibbles (evens) then
// their high (odds); 8 bits, each block's bytes. Zeros where no block is.
struct WChunk {
  __m256i v[8];
  int nb; // the chunk's blocks (fewer than 8 only in a row's last chunk): dots8 skips the rest
};
template <int BITS>
inline void load_chunk(const uint8_t* p, int nb, WChunk* w) {
  w->nb = nb;
  if constexpr (BITS == 4) {
    const __m256i m = _mm256_set1_epi8(15);
    for (int k = 0; k < 4; ++k) {
      const int left = nb - 2 * k;
      const __m256i b = left >= 2   ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * k))
                        : left == 1 ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * k)))
                                    : _mm256_setzero_si256();
      w->v[2 * k] = _mm256_and_si256(b, m);
      w->v[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
    }
  } else {
    for (int k = 0; k < 8; ++k)
      w->v[k] = k < nb ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * k)) : _mm256_setzero_si256();
  }
}
// 8 lanes, each the integer dot of 4 of w's bytes with x's, added to acc.
inline __m256i dot4(__m256i acc, __m256i w, const int8_t* xp) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
#ifdef QDOT_VNNI
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}
// Lane l: the exact integer dot of block lane_block(BITS, l) with x's chunk (0 past the blocks).
template <int BITS>
inline I dots8(const WChunk& w, const int8_t* x) {
  const __m256i z = _mm256_setzero_si256();
  if constexpr (BITS == 4) {
    __m256i r[4]; // pair k: lanes 0-3 its first block's, 4-7 its second's
    for (int k = 0; k < 4; ++k) // a pair past the last block: its zero weights' dot, 0, without the work
      r[k] = 2 * k < w.nb ? dot4(dot4(z, w.v[2 * k], x + 64 * k), w.v[2 * k + 1], x + 64 * k + 32) : z;
    return _mm256_hadd_epi32(_mm256_hadd_epi32(r[0], r[1]), _mm256_hadd_epi32(r[2], r[3]));
  } else {
    __m256i v[8];
    for (int b = 0; b < 8; ++b) {
      if (b >= w.nb) {
        v[b] = z;
        continue;
      }
#ifdef QDOT_VNNI
      v[b] = dot4(z, w.v[b], x + 32 * b);
#else
      // a whole byte times 127, twice, would overflow maddubs' 16 bits: two nibbles
      const __m256i m = _mm256_set1_epi8(15);
      const __m256i lo = dot4(z, _mm256_and_si256(w.v[b], m), x + 32 * b);
      const __m256i hi = dot4(z, _mm256_and_si256(_mm256_srli_epi16(w.v[b], 4), m), x + 32 * b);
      v[b] = _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4));
#endif
    }
    const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
  }
}
// dots8 of the chunk at p, each pair of blocks (4 bits) or block (8) loaded, masked and multiplied in
// turn: a few registers live, where a WChunk of 8 (held for several rows of x) spills at one row.
template <int BITS>
inline I dots8_at(const uint8_t* p, int nb, const int8_t* x) {
  const __m256i z = _mm256_setzero_si256();
  if constexpr (BITS == 4) {
    const __m256i m = _mm256_set1_epi8(15);
    __m256i r[4];
    for (int k = 0; k < 4; ++k) {
      const int left = nb - 2 * k;
      if (left <= 0) {
        r[k] = z;
        continue;
      }
      const __m256i b = left >= 2 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * k))
                                  : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * k)));
      r[k] = dot4(dot4(z, _mm256_and_si256(b, m), x + 64 * k), _mm256_and_si256(_mm256_srli_epi16(b, 4), m),
                  x + 64 * k + 32);
    }
    return _mm256_hadd_epi32(_mm256_hadd_epi32(r[0], r[1]), _mm256_hadd_epi32(r[2], r[3]));
  } else {
    WChunk w;
    load_chunk<8>(p, nb, &w);
    return dots8<8>(w, x);
  }
}
} // namespace
} // namespace mlxq::qdot::QDOT_NS

#include "qdot_impl.h"
