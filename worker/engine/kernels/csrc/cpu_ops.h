// Small CPU primitives that sit on the decode step's critical path next to
// the paged attention:
//
//   swiglu(gate, up) -> silu(gate) * up
//     float32 only. Bit-identical to mlx-lm's compiled swiglu on MLX's CPU
//     backend (the same exp polynomial, the same operation order, fma where
//     MLX uses std::fma), but 8 floats at a time with AVX2 where the CPU has
//     it: the x86-64 mlx wheel computes its elementwise math one float at a
//     time, which made this one activation ~6% of a decode step at batch 16.
//     From 32k floats on, split over the extension's thread pool.
//
//   paged_kv_write(k_pool, v_pool, keys, values, slots) -> (k_pool', v_pool')
//     keys (B, H, N, Dk), values (B, H, N, Dv), slots (B*N,) int32:
//     pool'[h, slots[b*N + n], :] = keys[b, h, n, :]. The pools are updated in
//     place when MLX can donate them (the usual case: the engine holds only the
//     newest version), if need be after the reads queued ahead of the write on
//     the stream have run; else copied first. Replaces two scatters (with their
//     int64 index arithmetic) and two transposed copies per layer.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlxq {

mx::array swiglu(const mx::array& gate, const mx::array& up);

// SwiGLU's task: n contiguous floats, on the pool where large. For fused ops: the same bits.
void swiglu_run(const float* gate, const float* up, float* out, int64_t n);

// mx.fast.rope(x, dims, traditional=..., base=..., scale=..., offset=...) for
// float32 x (B, H, T, D) and an int32 offset of size 1 or B: bit-identical to
// MLX's CPU RoPE, which is a graph of ~18 scalar ops (mlx/fast.cpp's
// fallback) taking 70-140 us per call; this computes a position's cos/sin with
// MLX's own exp and sincos (its shipped simd headers) once, and keeps it for the
// positions below 2^16 (every layer, queries and keys, asks for the same ones).
// RoPE's checks of dims and offsets (op: the caller, named in the messages) and the offsets as
// RoPE's task reads them: int32, one per row or one for all.
mx::array rope_offsets(const char* op, int dims, int head_dim, const mx::array& offsets, int rows);

// RoPE's task: x (B, H, T, D) at strides (sb, sh, st, 1) into y (B, H, T, D) contiguous, offsets
// op (n_off: 1 or B), on the pool where large. For fused ops: the same bits.
void rope_run(const float* xp, int64_t sb, int64_t sh, int64_t st, int B, int H, int T, int D,
              const int32_t* op, int n_off, int dims, bool traditional, float base, float scale, float* yp);

mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset);

std::vector<mx::array> paged_kv_write(
    const mx::array& k_pool,
    const mx::array& v_pool,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& slots);

// How many paged_kv_write evaluations had to copy their pool (it was still
// referenced elsewhere: a view, an array the caller kept, a second forward pass
// built from the same pool). The engine expects 0; tests check it.
int64_t kv_write_copies();

// How many paged_kv_write evaluations found their pool held only by reads
// queued ahead of them on the stream, waited for those, and wrote in place.
int64_t kv_write_waits();

// "avx2" or "generic": the swiglu loop this CPU runs.
const char* swiglu_isa();

// The ops below have no GPU implementation (on Metal, MLX's own ops run).
class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU stream only");
  }
};

class SwiGLU : public CpuPrimitive {
 public:
  explicit SwiGLU(mx::Stream stream) : CpuPrimitive(stream) {}
  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  // Gradients through MLX ops (training code may run in a process whose
  // model modules use this op).
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqSwiGLU";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

class RoPE : public CpuPrimitive {
 public:
  RoPE(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : CpuPrimitive(stream),
        dims_(dims),
        traditional_(traditional),
        base_(base),
        scale_(scale) {}
  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqRoPE";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
};

class PagedKVWrite : public CpuPrimitive {
 public:
  explicit PagedKVWrite(mx::Stream stream) : CpuPrimitive(stream) {}
  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqPagedKVWrite";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

} // namespace mlxq
