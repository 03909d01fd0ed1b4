// categorical sampling as one CPU primitive; see sample_ops.h.
#include "sample_ops.h"

#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "isa.h"
#include "pa_kernel.h"
#include "row_contiguous.h"
#include "thread_pool.h"

namespace mlxq {
namespace {

mlxq_pa::CategoricalFn pick() {
#if defined(MLXQ_PA_HAVE_AVX2)
  if (use_avx2_fma())
    return mlxq_pa::avx2::categorical;
#endif
  return mlxq_pa::generic::categorical;
}

const mlxq_pa::CategoricalFn g_categorical = pick();

mlxq_pa::ArgmaxFn pick_argmax() {
#if defined(MLXQ_PA_HAVE_AVX2)
  if (use_avx2_fma())
    return mlxq_pa::avx2::argmax;
#endif
  return mlxq_pa::generic::argmax;
}

const mlxq_pa::ArgmaxFn g_argmax = pick_argmax();

} // namespace

const char* categorical_isa() {
  return g_categorical == mlxq_pa::generic::categorical ? "generic" : "avx2";
}

mx::array categorical(const mx::array& logits, const mx::array& inv_temp, const mx::array& u) {
  if (logits.ndim() != 2)
    throw std::invalid_argument("categorical: logits must be (B, V)");
  const int B = logits.shape(0);
  if (inv_temp.ndim() != 1 || inv_temp.shape(0) != B || u.ndim() != 1 || u.shape(0) != B)
    throw std::invalid_argument("categorical: inv_temp and u must be (B,)");
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  auto f32 = [&](const mx::array& x) { return mx::astype(x, mx::float32, s); };
  return mx::array(
      {B}, mx::uint32, std::make_shared<Categorical>(s), {f32(logits), f32(inv_temp), f32(u)});
}

mx::array argmax(const mx::array& logits) {
  if (logits.ndim() != 2 || logits.dtype() != mx::float32)
    throw std::invalid_argument("argmax: logits must be float32 (B, V)");
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  return mx::array({logits.shape(0)}, mx::uint32, std::make_shared<Argmax>(s), {logits});
}

void Argmax::eval_cpu(
    const std::vector<mx::array>& given,
    std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const mx::array x = row_contiguous(given[0], encoder);
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_input_array(given[0]);
  encoder.set_output_array(out);
  const int B = x.shape(0);
  const int64_t V = x.shape(1);
  const float* xp = x.data<float>();
  uint32_t* o = out.data<uint32_t>();
  encoder.dispatch([xp, o, B, V]() {
    for (int b = 0; b < B; ++b)
      o[b] = (uint32_t)g_argmax(xp + (int64_t)b * V, V);
  });
}

void Categorical::eval_cpu(
    const std::vector<mx::array>& given,
    std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  std::vector<mx::array> in;
  for (const auto& x : given)
    in.push_back(row_contiguous(x, encoder));
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  for (const auto& x : given)
    encoder.set_input_array(x);
  encoder.set_output_array(out);
  const int B = in[0].shape(0);
  const int64_t V = in[0].shape(1);
  const float* x = in[0].data<float>();
  const float* t = in[1].data<float>();
  const float* u = in[2].data<float>();
  uint32_t* o = out.data<uint32_t>();
  encoder.dispatch([x, t, u, o, B, V]() {
    auto row = [&](int b) {
      thread_local std::vector<float> chunks;
      chunks.resize((size_t)(V + 7) / 8);
      o[b] = (uint32_t)g_categorical(x + (int64_t)b * V, V, t[b], u[b], chunks.data());
    };
    // ~2 ns a float (an 8-lane exp, then the chunk sums): 8 rows of an 8192-token vocabulary (n = 8's
    // samples) are ~0.15 ms of work, worth the pool's threads; a row's draw is its own on any thread.
    if ((int64_t)B * V >= (1 << 16))
      pool().parallel_for(B, row);
    else
      for (int b = 0; b < B; ++b)
        row(b);
  });
}

} // namespace mlxq
