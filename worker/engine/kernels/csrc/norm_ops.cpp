// rms_norm as one CPU primitive; see norm_ops.h.
#include "norm_ops.h"

#include <cmath>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "thread_pool.h"

namespace mlxq {

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32)
    throw std::invalid_argument("rms_norm: float32 only");
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("rms_norm: weight must be (D,) for x (..., D)");
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNormOp>(s, eps), {x, weight});
}

namespace {

// Where row r of x starts (x's rows: every index but the last), from its strides.
int64_t row_offset(const mx::array& x, int64_t r) {
  int64_t off = 0;
  for (int d = (int)x.ndim() - 2; d >= 0; --d) {
    off += (r % x.shape(d)) * x.strides()[d];
    r /= x.shape(d);
  }
  return off;
}

// R rows at once: each row's sum of squares is its own chain of adds in its own order (one
// float at a time from 0, as MLX), so a row's bits do not depend on R; R chains side by side
// keep the adder busy where one chain waits on each add's latency (~8x at 64 rows of 512).
constexpr int kRows = 8;

template <int R>
inline void norm_rows(const float* xp, const int64_t* starts, int64_t xs, const float* wp, int64_t ws,
                      float* op, int64_t D, float inv_n, float eps) {
  const float* xr[R];
  float acc[R];
  for (int k = 0; k < R; ++k) {
    xr[k] = xp + starts[k];
    acc[k] = 0.0f;
  }
  for (int64_t d = 0; d < D; ++d)
    for (int k = 0; k < R; ++k) {
      const float v = xr[k][d * xs];
      const float sq = v * v;
      acc[k] = acc[k] + sq;
    }
  for (int k = 0; k < R; ++k) {
    const float sum = 0.0f + acc[k];
    const float mean = sum * inv_n;
    const float rs = 1.0f / std::sqrt(mean + eps);
    float* o = op + k * D;
    for (int64_t d = 0; d < D; ++d) {
      const float y = xr[k][d * xs] * rs;
      o[d] = y * wp[d * ws];
    }
  }
}

} // namespace

void RMSNormOp::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(w);
  encoder.set_output_array(out);
  const int64_t D = x.shape(-1);
  const int64_t rows = D ? (int64_t)x.size() / D : 0;
  std::vector<int64_t> starts(rows);
  for (int64_t r = 0; r < rows; ++r)
    starts[r] = row_offset(x, r);
  const int64_t xs = x.strides().back(), ws = w.strides()[0];
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  float* op = out.data<float>();
  const float eps = eps_;
  encoder.dispatch([xp, wp, op, D, rows, xs, ws, eps, starts = std::move(starts)]() {
    rms_norm_run(xp, starts.data(), xs, wp, ws, op, rows, D, eps);
  });
}

void rms_norm_run(const float* xp, const int64_t* starts, int64_t xs, const float* wp, int64_t ws, float* op,
                  int64_t rows, int64_t D, float eps) {
  const float inv_n = static_cast<float>(1.0 / (double)D);
  // Rows [r0, r1), kRows at a time from r0 (a row's value does not depend on its group).
  auto run = [&](int64_t r0, int64_t r1) {
    int64_t r = r0;
    for (; r + kRows <= r1; r += kRows)
      norm_rows<kRows>(xp, starts + r, xs, wp, ws, op + r * D, D, inv_n, eps);
    for (; r < r1; ++r)
      norm_rows<1>(xp, starts + r, xs, wp, ws, op + r * D, D, inv_n, eps);
  };
  // Large calls (a batch-64 decode step: 64 x 512 floats) on the pool's threads, in parts of
  // whole groups of kRows rows.
  split_ranges(pool(), rows, rows * D, kRows, run);
}

void rms_norm_rows_run(const float* xp, const float* wp, int64_t ws, float* op, int64_t rows, int64_t D,
                       float eps) {
  thread_local std::vector<int64_t> starts;
  starts.resize(rows);
  for (int64_t r = 0; r < rows; ++r)
    starts[r] = r * D;
  rms_norm_run(xp, starts.data(), 1, wp, ws, op, rows, D, eps);
}

} // namespace mlxq
