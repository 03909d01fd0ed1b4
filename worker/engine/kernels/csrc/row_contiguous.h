// Inputs made row-contiguous inside a primitive's eval_cpu, not by a Contiguous
// node in the graph.
//
// mx::contiguous(x) in front of each input of our ops added a primitive per
// input (~120 of a decode step's ~680 on a small llama), each one a task on the
// CPU stream even when x already was contiguous, which it almost always is.
// row_contiguous(x, encoder) returns x itself when its flags say so; otherwise a
// new row-contiguous array, filled by a copy task dispatched now, so it runs
// before the caller's own task on the same stream. The caller keeps it alive with
// encoder.add_temporary.
#pragma once

#include <cstring>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlxq {

inline mx::array row_contiguous(const mx::array& x, mx::cpu::CommandEncoder& encoder) {
  if (x.flags().row_contiguous)
    return x;
  mx::array out(x.shape(), x.dtype(), nullptr, {});
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.dispatch([x, out]() mutable {
    const int nd = (int)x.ndim();
    const size_t es = x.itemsize();
    const auto& shape = x.shape();
    const auto& strides = x.strides();
    // The trailing dimensions x stores as one contiguous run (a dimension of size 1 is in it
    // whatever its stride): each run one memcpy, the outer dimensions walked as before. Element
    // by element, this copy was ~3% of a batch-64 decode step's MLX thread (perf, the bench
    // model: the values the KV write gets as (B, H, N, D) views of the projections, and the
    // queries and keys RoPE got the same way before it read them in place).
    int inner = nd;
    int64_t run = 1;
    while (inner > 0 && (shape[inner - 1] == 1 || strides[inner - 1] == run))
      run *= shape[--inner];
    if (run == 0)
      return;
    const char* src = x.data<char>();
    char* dst = out.data<char>();
    const size_t bytes = (size_t)run * es;
    std::vector<int64_t> idx(inner, 0);
    int64_t off = 0; // element offset of idx in x
    for (size_t i = 0, n = x.size() / (size_t)run; i < n; ++i) {
      std::memcpy(dst + i * bytes, src + off * (int64_t)es, bytes);
      for (int d = inner - 1; d >= 0; --d) { // next run, the innermost outer dimension fastest
        off += strides[d];
        if (++idx[d] < shape[d])
          break;
        off -= strides[d] * shape[d];
        idx[d] = 0;
      }
    }
  });
  encoder.add_temporary(out);
  return out;
}

} // namespace mlxq
