// Python bindings of the paged attention primitive. NB_DOMAIN mlx (set in
// CMakeLists.txt) shares nanobind's type registry with mlx.core, so mx.array
// crosses over; mlx.core must be imported before this module.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <optional>

#include "paged_attention.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_mlxq_paged_attention, m) {
  m.doc() = "mlxq paged attention (CPU primitive)";
  m.def(
      "paged_attention",
      [](const mx::array& queries,
         const mx::array& k_pool,
         const mx::array& v_pool,
         const mx::array& block_tables,
         const mx::array& q_offsets,
         const mx::array& kv_lens,
         float scale,
         std::optional<int> window,
         int block_size) {
        return mlxq::paged_attention(
            queries,
            k_pool,
            v_pool,
            block_tables,
            q_offsets,
            kv_lens,
            scale,
            window.value_or(0),
            block_size);
      },
      "queries"_a,
      "k_pool"_a,
      "v_pool"_a,
      "block_tables"_a,
      "q_offsets"_a,
      "kv_lens"_a,
      "scale"_a,
      "window"_a = nb::none(),
      "block_size"_a = 32,
      "Attention over KV blocks read in place from the pools; see "
      "paged_attention.h.");
  m.def("num_threads", &mlxq::num_threads, "Threads the op runs on.");
  m.def("isa", &mlxq::isa, "The inner loop this CPU runs: avx2 or generic.");
}
