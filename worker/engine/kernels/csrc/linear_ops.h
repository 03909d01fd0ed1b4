// linear(x, w, bias): x @ w^T (+ bias) for float32, the weight matmuls of a model's
// Linear layers, split over output columns on the extension's thread pool (4 parts per
// thread, claimed by whichever thread is free). Each part is our own loop where the CPU
// has AVX2 and FMA (rowdot.h: the weights read where they lie, each output summed in one
// order whatever the batch), else a single-threaded call into the process's BLAS
// (OpenBLAS, preloaded by mlxq.worker.blas): sgemm for several rows, sgemv for one.
//
// Why not MLX's own matmul (one cblas_sgemm call, OpenBLAS's threads):
//
// * One row (a decode step at batch 1): OpenBLAS's sgemm at M = 1 reads the weights
//   at about half the machine's bandwidth (10.5 ms for the bench model's 100 MB on
//   these 2 cores); its sgemv takes 5.6 ms.
// * A decode step's few rows: OpenBLAS's sgemm packs the weight panel on every call
//   (sgemm_incopy: a third of a batch-16 step on the bench model, more than its kernel).
//   Our loops read each weight row once per 64 rows of x, unpacked: at 16 rows the
//   bench model's matmuls take ~1.8 ms against ~2.1 (MLX) and ~3.2 (split sgemm).
// * Any batch: between two calls an idle OpenBLAS thread spins on its core without
//   yielding, so the paged attention's pool, which runs between the matmuls, lost one
//   of the 2 cores to it (8 layers' attention: 9.5 ms alone, 15-19 ms with a matmul
//   before each layer). With the matmuls on the same pool, OpenBLAS runs
//   single-threaded in this op (its thread count is set to 1 for the call and put
//   back after), its threads stay asleep, and the pool's threads, which sleep on a
//   condition variable, have both cores to themselves.
//
// Not bit-identical to MLX's matmul: our loops sum each dot product in their own order.
// A row's bits do not depend on its batch, its columns' split or the ISA build (rowdot.h),
// so a greedy row batched equals its solo run, as with MLX's matmul. On the BLAS fallback
// (no AVX2+FMA) that does not hold: sgemm can round a column differently when the columns
// are split differently (seen at 64 rows) and at 1 and 2 threads, and sgemv sums in
// another order. model_ops checks the op against a float32 error bound, not for equality.
//
// x: float32 (..., K), any strides (copied to rows if need be); w: float32 (N, K),
// rows or columns contiguous (else copied); bias: float32 (N,) or none.
#pragma once

#include <cstdint>
#include <optional>

#include "cpu_ops.h"
#include "rowdot.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlxq {

// The BLAS entry points, from Python (ctypes addresses in the library blas.py loaded):
// cblas_sgemm, cblas_sgemv, openblas_set_num_threads, openblas_get_num_threads (the
// last two may be 0: then the BLAS's thread count is left alone).
void set_blas(uintptr_t sgemm, uintptr_t sgemv, uintptr_t set_threads, uintptr_t get_threads);
bool has_blas();

// The loops linear() runs: "avx512vl" or "avx2" (rowdot.h), or "blas" (sgemm/sgemv).
const char* linear_isa();

// Our own loops (rowdot.h's matmul where the CPU has AVX2 and FMA; nullptr: linear uses the BLAS),
// and x's M rows packed once for every part of a call (null where those loops do not read a
// packing): for quantized_linear, whose weights, dequantized a strip at a time, go through them.
rowdot::MatmulFn rowdot_loops();
const float* rowdot_pack(const float* x, int M, int K, std::vector<float>& buf);

// One weight of a call: where its rows are and where its output goes.
struct LinearTarget {
  const float* w;
  bool w_rows; // rows contiguous (a weight as stored); else columns (a transposed view)
  int ldw, N;
  const float* bias; // nullptr: none
  int64_t bias_stride;
  float* y; // M rows of N
};

// A weight (N, K) and its bias (or nullptr) as a target, registered with the encoder (a weight
// in neither layout is copied first); y is left for the caller to set.
LinearTarget linear_target(const mx::array& w, const mx::array* bias, int K, mx::cpu::CommandEncoder& encoder);

// y = x @ w^T (+ bias) for every target, M rows of x (K wide, contiguous): Linear's task, on the
// pool; a fused op that calls it gets each output bit for bit as linear() would.
void linear_run(const std::vector<LinearTarget>& targets, const float* xp, int M, int K);

mx::array linear(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias);

// Several weights applied to one x as one primitive and one pass of the pool: [x @ w_i^T
// (+ bias_i)] (a layer's q/k/v projections, an MLP's gate and up). Each weight is split into
// the very parts linear(x, w_i, bias_i) makes, so each output is that call's bit for bit
// (a weight of 16 columns or fewer is one part, which linear() alone runs on the calling
// thread, the BLAS's call with the BLAS's own threads, here on one of the pool's); what it saves is the per-call cost (an MLX task and a wake-up of
// the pool) of all but one matmul. biases: one per weight, or none.
std::vector<mx::array> linear_group(
    const mx::array& x,
    const std::vector<mx::array>& ws,
    const std::vector<mx::array>& biases);

class Linear : public CpuPrimitive {
 public:
  Linear(mx::Stream stream, int groups, bool has_bias)
      : CpuPrimitive(stream), groups_(groups), has_bias_(has_bias) {}
  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MlxqLinear";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int groups_;
  bool has_bias_;
};

} // namespace mlxq
