// Paged attention, CPU inner loop: one (row, kv head) over a range of KV blocks.
//
// This header holds no MLX types. The implementation (pa_kernel_impl.h) is
// compiled by pa_kernel_generic.cpp (the target's baseline ISA) and, on x86-64,
// by pa_kernel_avx2.cpp (with -mavx2 -mfma) and pa_kernel_avx512.cpp (the same
// 8-lane loops with AVX-512VL's 32 registers, so wider tiles of queries and the
// same bits). paged_attention.cpp picks one at run time (__builtin_cpu_supports),
// so the built library never runs an instruction the CPU it lands on lacks, even
// if the cache dir moves between machines.
#pragma once

#include <cstdint>

namespace mlxq_pa {

enum class PoolType : int { f32 = 0, f16 = 1, bf16 = 2 };

// Everything one call of the op needs; pointers are row-contiguous arrays.
// A quantized pool (bits 4 or 8): k/v hold mx.quantize's packed uint32 rows
// (Hkv, S, D * bits / 32) and ks/kb/vs/vb the affine groups' scales and
// biases (Hkv, S, D / group), of type pool_type.
struct Args {
  const void* k; // (Hkv, S, Dk) pool, PoolType (packed uint32 when quantized)
  const void* v; // (Hkv, S, Dv) pool, PoolType (packed uint32 when quantized)
  const void* ks = nullptr; // quantized only: key scales (Hkv, S, Dk / group)
  const void* kb = nullptr; // key biases
  const void* vs = nullptr; // value scales (Hkv, S, Dv / group)
  const void* vb = nullptr; // value biases
  int bits = 0; // 0: a float pool; else 4 or 8
  int group = 0; // elements per scale/bias group (a multiple of 32)
  const int32_t* tables; // (B, nb)
  const int32_t* q_off; // (B,)
  const int32_t* kv_len; // (B,)
  PoolType pool_type;
  int B, Hq, Hkv, N, Dk, Dv, nb, num_blocks, block_size;
  int window; // 0: no window
};

// The key range that row b can see at all (union over its queries), clamped to
// the block table; [lo, hi) in token positions. Empty when hi <= lo.
inline void row_key_range(const Args& a, int b, int& lo, int& hi) {
  const int64_t off = a.q_off[b];
  int64_t h = off + a.N; // the last query sees up to off + N - 1
  if (h > a.kv_len[b])
    h = a.kv_len[b];
  if (h > (int64_t)a.nb * a.block_size)
    h = (int64_t)a.nb * a.block_size;
  int64_t l = 0;
  if (a.window > 0 && off - a.window + 1 > 0)
    l = off - a.window + 1;
  lo = (int)l;
  hi = h < 0 ? 0 : (int)h;
}

// One row's share of an attend call: its G*N queries of the kv head (index
// g*N + n, fp32, already multiplied by the scale), the logical blocks [t0, t1)
// it attends, and where its m (running max), l (sum of exponentials) and acc
// (unnormalized sum of p*v, Dv floats per query) go. A query that saw no key
// gets m = -inf, l = 0, acc = 0.
struct Member {
  int b;
  int t0, t1;
  const float* q;
  float* m;
  float* l;
  float* acc;
};

// The most rows one attend call takes (paged_attention.cpp's plan groups at most
// this many rows that share their blocks into one task).
constexpr int kMaxMembers = 8;

// Attend rows[0..nrows) for kv head hk, block by block: every member that has
// block t in its range takes it before any member moves to block t + 1. Each
// member's arithmetic is exactly what it would be alone (the same blocks in the
// same order, the same operations), so grouping rows changes no bit; rows that
// share physical blocks (the n samples of one prompt, prefix-cache hits) read a
// shared block from memory once for all of them, and a 16-bit block is converted
// once (a quantized one's integers too, when its queries take several tiles).
// scratch: block_size * (Dk + Dv) floats.
//
// next: the task the calling thread runs after this one, or null. Its first kPrefetchAhead
// blocks are prefetched behind this task's own, as if they were this task's next blocks, so
// that a short task (a decode row of a few blocks) does not start on a cold read; only its hk
// and its members' b, t0, t1 are read. prefetched: how many of this task's own first blocks
// the task before it prefetched that way (attend returns that count for next).
struct Next {
  int hk;
  const Member* rows;
  int nrows;
};

// How many blocks ahead of its arithmetic a task prefetches (see pa_kernel_impl.h).
constexpr int kPrefetchAhead = 2;

using AttendFn =
    int (*)(const Args& a, int hk, const Member* rows, int nrows, float* scratch, const Next* next, int prefetched);

// Categorical sampling of one row of V logits x at temperature 1 / inv_temp,
// with u in [0, 1) the row's uniform draw: the smallest index whose prefix sum
// of exp((x - max) * inv_temp) exceeds u times the whole sum (inverse CDF), the
// exponentials from the same polynomial as the attention's softmax, 8 at a time.
// Masked logits (-inf) have probability 0 and are never drawn; a row with no
// finite logit gives 0. chunks: (V + 7) / 8 floats of scratch.
using CategoricalFn = int64_t (*)(const float* x, int64_t V, float inv_temp, float u, float* chunks);

// The index of the largest of V logits: the first one where several are equal
// (as MLX's argmax); NaN never wins. 8 lanes at a time.
using ArgmaxFn = int64_t (*)(const float* x, int64_t V);

// One implementation per instruction set (pa_kernel_impl.h, compiled twice).
namespace generic {
int attend(const Args&, int, const Member*, int, float*, const Next*, int);
int64_t categorical(const float*, int64_t, float, float, float*);
int64_t argmax(const float*, int64_t);
}
namespace avx2 {
int attend(const Args&, int, const Member*, int, float*, const Next*, int);
int64_t categorical(const float*, int64_t, float, float, float*);
int64_t argmax(const float*, int64_t);
}
namespace avx512 { // attend with 32 registers (its categorical and argmax: the avx2 ones)
int attend(const Args&, int, const Member*, int, float*, const Next*, int);
}

} // namespace mlxq_pa
