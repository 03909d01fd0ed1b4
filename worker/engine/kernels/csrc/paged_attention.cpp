// Paged attention as an MLX primitive: the op, the work plan and the threads.
//
// Work is split over (row, kv head) and, for a long row, over fixed block
// ranges of it (split-K, each part producing (m, l, acc) that a second pass
// combines; see plan() for why the ranges never follow the batch). Pieces of
// rows that share their blocks (forked samples, prefix hits) run together, so a
// shared block is read once for all of them. The inner loop lives in
// pa_kernel_impl.h.
#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>


#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "isa.h"
#include "pa_kernel.h"
#include "row_contiguous.h"
#include "thread_pool.h"

namespace mlxq {
namespace {

using mlxq_pa::Args;
using mlxq_pa::AttendFn;
using mlxq_pa::PoolType;

AttendFn pick_attend() {
#if defined(MLXQ_PA_HAVE_AVX2)
  if (mlxq::use_avx512vl())
    return mlxq_pa::avx512::attend;
  if (mlxq::use_avx2_fma())
    return mlxq_pa::avx2::attend;
#endif
  return mlxq_pa::generic::attend;
}

const AttendFn g_attend = pick_attend();

// ---------------------------------------------------------------- plan
// One row's share of the work for one kv head: blocks [t0, t1) of row b.
struct Piece {
  int b, t0, t1;
  int64_t part; // -1: the whole row, finalized into out; else index of its partial
};

// A task: one kv head, pieces[first, first + count) attended together, block
// by block (rows that share their blocks read them once; see AttendFn).
struct Task {
  int hk, first, count;
};

struct Group {
  int b, hk;
  int64_t part0; // first partial
  int nparts;
};

// A row longer than kPartBlocks blocks is split into parts on a fixed grid of
// kPartBlocks blocks counted from block 0 (split-K: each part's (m, l, acc),
// then one combine in part order). The grid depends on nothing but the row's
// own keys: not on the batch, the thread count or how many of the row's tokens
// are queried, so a row gets the same bits alone or in any batch, at decode or
// inside a prefill chunk (the engine's batched == solo and exact resume rest on
// it). Rows up to kPartBlocks blocks run whole.
constexpr int kPartBlocks = 16;

// Consecutive tasks run on one thread as a chunk, each prefetching the first blocks of the
// next (see AttendFn), up to kChunkBlocks blocks walked a chunk (and at least kChunksPerThread
// chunks a thread, for the threads to even out). Short tasks gain most (a decode row of ~3
// blocks at batch 64: attention alone, 64 rows at 85 tokens, alternating processes, three runs:
// 5.56 / 5.54 / 5.25 -> 4.43 / 5.21 / 4.46 ms); long ones start cold on 2 of their 16 blocks
// anyway, and in chunks of 8 the pieces of 16 rows x 1000 tokens on an 8-bit pool (then
// dequantizing every element, not waiting on memory) evened out worse: 1051 -> 1003 tok/s.
constexpr int kChunkBlocks = 16;
constexpr int kChunksPerThread = 8;

void plan(
    const Args& a,
    std::vector<Piece>& pieces,
    std::vector<Task>& tasks,
    std::vector<Group>& groups,
    int64_t& nparts) {
  const int BS = a.block_size;
  nparts = 0;
  // The pieces of one kv head (every head's are the same but for the partials).
  struct Span {
    int b, t0, t1, s; // s: part number in the row (-1: whole)
  };
  std::vector<Span> spans;
  std::vector<int> row_parts(a.B);
  for (int b = 0; b < a.B; ++b) {
    int lo, hi;
    mlxq_pa::row_key_range(a, b, lo, hi);
    const int tlo = lo / BS;
    const int thi = hi > lo ? (hi + BS - 1) / BS : tlo;
    const int p0 = tlo / kPartBlocks;
    const int ns = thi > tlo ? (thi - 1) / kPartBlocks + 1 - p0 : 1;
    row_parts[b] = ns;
    if (ns == 1) {
      spans.push_back({b, tlo, thi, -1});
      continue;
    }
    for (int s = 0; s < ns; ++s)
      spans.push_back({b, std::max(tlo, (p0 + s) * kPartBlocks), std::min(thi, (p0 + s + 1) * kPartBlocks), s});
  }
  // Spans that start at the same logical block on the same pool block (forked
  // samples, prefix-cache hits: rows that share their first blocks) go together,
  // at most mlxq_pa::kMaxMembers to a task; which rows go together changes no bit.
  std::vector<int> order(spans.size());
  std::vector<int64_t> keys(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& x = spans[i];
    order[i] = (int)i;
    keys[i] = x.t1 <= x.t0 ? -1 - (int64_t)i // empty: alone
                           : ((int64_t)x.t0 << 32) | (uint32_t)a.tables[(int64_t)x.b * a.nb + x.t0];
  }
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return keys[x] < keys[y]; });
  std::vector<std::pair<int, int>> runs; // [begin, end) of order
  for (size_t i = 0; i < order.size();) {
    size_t j = i + 1;
    while (j < order.size() && j - i < (size_t)mlxq_pa::kMaxMembers && keys[order[j]] == keys[order[i]])
      ++j;
    runs.push_back({(int)i, (int)j});
    i = j;
  }
  // Larger runs first: the threads take tasks in order, so the long ones start early.
  std::stable_sort(runs.begin(), runs.end(), [](const auto& x, const auto& y) {
    return x.second - x.first > y.second - y.first;
  });
  // Partials: row b's parts for head hk are contiguous (the combine reads them in order).
  std::vector<int64_t> part0((size_t)a.B * a.Hkv, -1);
  for (int b = 0; b < a.B; ++b)
    for (int hk = 0; hk < a.Hkv; ++hk)
      if (row_parts[b] > 1) {
        part0[(size_t)b * a.Hkv + hk] = nparts;
        groups.push_back({b, hk, nparts, row_parts[b]});
        nparts += row_parts[b];
      }
  for (int hk = 0; hk < a.Hkv; ++hk)
    for (const auto& run : runs) {
      tasks.push_back({hk, (int)pieces.size(), run.second - run.first});
      for (int i = run.first; i < run.second; ++i) {
        const Span& x = spans[order[i]];
        pieces.push_back({x.b, x.t0, x.t1, x.s < 0 ? -1 : part0[(size_t)x.b * a.Hkv + hk] + x.s});
      }
    }
}

// ---------------------------------------------------------------- eval
template <typename T>
void run(
    const Args& a,
    const T* q,
    T* out,
    float scale) {
  const int G = a.Hq / a.Hkv;
  const int GN = G * a.N;
  const int Dk = a.Dk, Dv = a.Dv;
  ThreadPool& tp = pool();
  std::vector<Piece> pieces;
  std::vector<Task> tasks;
  std::vector<Group> groups;
  int64_t nparts = 0;
  plan(a, pieces, tasks, groups, nparts);

  // Partials of split rows: per part and query, m, l and Dv accumulators.
  const int64_t part_stride = (int64_t)GN * (Dv + 2);
  std::vector<float> partials((size_t)(nparts * part_stride));

  auto group_queries = [&](int b, int hk) {
    return q + ((int64_t)b * a.Hq + (int64_t)hk * G) * a.N * Dk;
  };
  auto group_out = [&](int b, int hk) {
    return out + ((int64_t)b * a.Hq + (int64_t)hk * G) * a.N * Dv;
  };

  // Task ti on this thread; next: the task it runs after, prefetched behind this one.
  auto run_task = [&](int ti, const Task* next, int prefetched) {
    const Task& t = tasks[ti];
    thread_local std::vector<float> scratch;
    thread_local std::vector<mlxq_pa::Member> members, next_members;
    // per piece: its scaled queries and, for a whole row, its (m, l, acc); then one block's conversion
    const size_t per = (size_t)GN * Dk + (size_t)GN * (Dv + 2);
    const size_t need = per * t.count + (size_t)a.block_size * (Dk + Dv);
    if (scratch.size() < need)
      scratch.resize(need);
    members.resize(t.count);
    for (int r = 0; r < t.count; ++r) {
      const Piece& pc = pieces[t.first + r];
      float* qs = scratch.data() + per * r;
      const T* qg = group_queries(pc.b, t.hk);
      for (int64_t i = 0; i < (int64_t)GN * Dk; ++i)
        qs[i] = static_cast<float>(qg[i]) * scale;
      float* m = pc.part < 0 ? qs + (size_t)GN * Dk : partials.data() + pc.part * part_stride;
      members[r] = {pc.b, pc.t0, pc.t1, qs, m, m + GN, m + 2 * GN};
    }
    mlxq_pa::Next nx{0, nullptr, 0};
    if (next != nullptr) {
      next_members.resize(next->count);
      for (int r = 0; r < next->count; ++r) {
        const Piece& pc = pieces[next->first + r];
        next_members[r] = {pc.b, pc.t0, pc.t1, nullptr, nullptr, nullptr, nullptr};
      }
      nx = {next->hk, next_members.data(), next->count};
    }
    const int ahead = g_attend(a, t.hk, members.data(), t.count, scratch.data() + per * t.count,
                               next != nullptr ? &nx : nullptr, prefetched);
    for (int r = 0; r < t.count; ++r) {
      const Piece& pc = pieces[t.first + r];
      if (pc.part >= 0)
        continue;
      const mlxq_pa::Member& mr = members[r];
      T* o = group_out(pc.b, t.hk);
      for (int i = 0; i < GN; ++i) {
        const float inv = mr.l[i] > 0.0f ? 1.0f / mr.l[i] : 0.0f;
        for (int d = 0; d < Dv; ++d)
          o[(int64_t)i * Dv + d] = static_cast<T>(mr.acc[(int64_t)i * Dv + d] * inv);
      }
    }
    return ahead;
  };

  // Chunks of consecutive tasks: [chunks[c], chunks[c + 1]).
  const int ntasks = (int)tasks.size();
  const int max_count = std::max(1, ntasks / (kChunksPerThread * tp.size()));
  std::vector<int> chunks;
  int blocks = 0;
  for (int ti = 0; ti < ntasks; ++ti) {
    int tb = 0; // blocks the task walks
    for (int r = 0; r < tasks[ti].count; ++r) {
      const Piece& pc = pieces[tasks[ti].first + r];
      tb = std::max(tb, pc.t1 - pc.t0);
    }
    if (chunks.empty() || ti - chunks.back() >= max_count || blocks + tb > kChunkBlocks) {
      chunks.push_back(ti);
      blocks = 0;
    }
    blocks += tb;
  }
  chunks.push_back(ntasks);
  tp.parallel_for((int)chunks.size() - 1, [&](int ci) {
    int prefetched = 0;
    const int tend = chunks[ci + 1];
    for (int ti = chunks[ci]; ti < tend; ++ti)
      prefetched = run_task(ti, ti + 1 < tend ? &tasks[ti + 1] : nullptr, prefetched);
  });

  // Combine the parts of split rows.
  tp.parallel_for((int)groups.size(), [&](int gi) {
    const Group& g = groups[gi];
    T* o = group_out(g.b, g.hk);
    for (int i = 0; i < GN; ++i) {
      float mx_ = -std::numeric_limits<float>::infinity();
      for (int s = 0; s < g.nparts; ++s)
        mx_ = std::max(mx_, partials[(g.part0 + s) * part_stride + i]);
      float L = 0.0f;
      for (int d = 0; d < Dv; ++d)
        o[(int64_t)i * Dv + d] = static_cast<T>(0.0f);
      if (mx_ == -std::numeric_limits<float>::infinity())
        continue;
      thread_local std::vector<float> sum;
      sum.assign(Dv, 0.0f);
      for (int s = 0; s < g.nparts; ++s) {
        const float* base = partials.data() + (g.part0 + s) * part_stride;
        const float ls = base[GN + i];
        if (ls == 0.0f)
          continue;
        const float w = std::exp(base[i] - mx_);
        L += ls * w;
        const float* acc = base + 2 * GN + (int64_t)i * Dv;
        for (int d = 0; d < Dv; ++d)
          sum[d] += acc[d] * w;
      }
      const float inv = L > 0.0f ? 1.0f / L : 0.0f;
      for (int d = 0; d < Dv; ++d)
        o[(int64_t)i * Dv + d] = static_cast<T>(sum[d] * inv);
    }
  });
}

PoolType pool_type(mx::Dtype t) {
  if (t == mx::float32)
    return PoolType::f32;
  if (t == mx::float16)
    return PoolType::f16;
  if (t == mx::bfloat16)
    return PoolType::bf16;
  throw std::invalid_argument(
      "paged_attention: the KV pools must be float32, float16 or bfloat16");
}

using Fail = void (*)(const std::string&);

// The checks of a quantized call; returns the value head dim.
int check_quant(
    const mx::array& k_pool,
    const mx::array& v_pool,
    const mlxq::KVQuantArrays& q,
    int Hkv,
    int S,
    int D,
    Fail fail) {
  if (q.bits != 4 && q.bits != 8)
    fail("bits must be 4 or 8");
  if (q.group_size <= 0 || q.group_size % 32 != 0 || D % q.group_size != 0)
    fail("group_size must be a multiple of 32 dividing the head dims");
  if (k_pool.dtype() != mx::uint32 || v_pool.dtype() != mx::uint32)
    fail("quantized pools must be packed uint32 (mx.quantize)");
  for (const auto* x : {&q.k_scales, &q.k_biases, &q.v_scales, &q.v_biases}) {
    if (x->ndim() != 3 || x->shape(0) != Hkv || x->shape(1) != S)
      fail("scales and biases must be (Hkv, S, D / group_size)");
    if (x->dtype() != q.k_scales.dtype())
      fail("scales and biases must have one dtype");
  }
  pool_type(q.k_scales.dtype());
  const int Dv = q.v_scales.shape(2) * q.group_size;
  if (q.k_scales.shape(2) * q.group_size != D || q.k_biases.shape(2) != q.k_scales.shape(2) ||
      q.v_biases.shape(2) != q.v_scales.shape(2))
    fail("scales/biases disagree with the head dims and group_size");
  if ((int64_t)k_pool.shape(2) * 32 != (int64_t)D * q.bits ||
      (int64_t)v_pool.shape(2) * 32 != (int64_t)Dv * q.bits)
    fail("packed pool rows must be D * bits / 32 words");
  return Dv;
}

} // namespace

// ---------------------------------------------------------------- op
mx::array paged_attention(
    const mx::array& queries,
    const mx::array& k_pool,
    const mx::array& v_pool,
    const mx::array& block_tables,
    const mx::array& q_offsets,
    const mx::array& kv_lens,
    float scale,
    int window,
    int block_size,
    const std::optional<KVQuantArrays>& quant) {
  Fail fail = [](const std::string& msg) {
    throw std::invalid_argument("paged_attention: " + msg);
  };
  if (queries.ndim() != 4)
    fail("queries must be (B, Hq, N, D)");
  if (k_pool.ndim() != 3 || v_pool.ndim() != 3)
    fail("the pools must be (Hkv, S, D)");
  if (block_tables.ndim() != 2)
    fail("block_tables must be (B, nb)");
  const int B = queries.shape(0), Hq = queries.shape(1), D = queries.shape(3);
  const int Hkv = k_pool.shape(0), S = k_pool.shape(1);
  if (v_pool.shape(0) != Hkv || v_pool.shape(1) != S)
    fail("k_pool and v_pool disagree on heads or slots");
  const int Dv = quant ? check_quant(k_pool, v_pool, *quant, Hkv, S, D, fail) : v_pool.shape(2);
  if (!quant && k_pool.shape(2) != D)
    fail("queries and k_pool disagree on the head dim");
  if (Hkv <= 0 || Hq % Hkv != 0)
    fail("query heads must be a multiple of KV heads");
  if (block_size <= 0 || block_size > 64 || block_size % 8 != 0)
    fail("block_size must be a multiple of 8, at most 64");
  if (S % block_size != 0)
    fail("the pool's slot count is not a multiple of block_size");
  if (D % 8 != 0 || Dv % 8 != 0 || D > 1024 || Dv > 1024)
    fail("head dims must be multiples of 8 (at most 1024)");
  if (block_tables.shape(0) != B || q_offsets.ndim() != 1 ||
      q_offsets.shape(0) != B || kv_lens.ndim() != 1 || kv_lens.shape(0) != B)
    fail("block_tables, q_offsets and kv_lens need one row per batch row");
  if (k_pool.dtype() != v_pool.dtype())
    fail("k_pool and v_pool must have one dtype");
  if (!quant)
    pool_type(k_pool.dtype());
  if (!mx::issubdtype(queries.dtype(), mx::floating))
    fail("queries must be floating point");
  if (queries.dtype() != mx::float32 && queries.dtype() != mx::float16 &&
      queries.dtype() != mx::bfloat16)
    fail("queries must be float32, float16 or bfloat16");
  if (window < 0)
    fail("window must be positive (or 0 for none)");

  // The CPU stream, whatever the default device: this primitive has no GPU
  // implementation (on Metal, worker/engine/attention.py uses its own kernel).
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  // No Contiguous nodes: eval_cpu copies an input that is not row-contiguous (row_contiguous.h).
  auto i32 = [&](const mx::array& x) { return mx::astype(x, mx::int32, s); };
  std::vector<mx::array> inputs = {
      queries, k_pool, v_pool, i32(block_tables), i32(q_offsets), i32(kv_lens)};
  if (quant)
    for (const auto* x : {&quant->k_scales, &quant->k_biases, &quant->v_scales, &quant->v_biases})
      inputs.push_back(*x);
  return mx::array(
      {B, Hq, queries.shape(2), Dv},
      queries.dtype(),
      std::make_shared<PagedAttention>(
          s, scale, window, block_size, quant ? quant->bits : 0, quant ? quant->group_size : 0),
      std::move(inputs));
}


const char* isa() {
  if (g_attend == mlxq_pa::generic::attend)
    return "generic";
#if defined(MLXQ_PA_HAVE_AVX2)
  if (g_attend == mlxq_pa::avx512::attend)
    return "avx512vl";
#endif
  return "avx2";
}

void PagedAttention::eval_cpu(
    const std::vector<mx::array>& given,
    std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  std::vector<mx::array> inputs;
  for (const auto& x : given)
    inputs.push_back(row_contiguous(x, encoder));
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  const auto& tables = inputs[3];
  const auto& q_off = inputs[4];
  const auto& kv_len = inputs[5];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));

  Args a;
  a.k = k.data<uint8_t>();
  a.v = v.data<uint8_t>();
  a.tables = tables.data<int32_t>();
  a.q_off = q_off.data<int32_t>();
  a.kv_len = kv_len.data<int32_t>();
  a.bits = bits_;
  a.group = group_size_;
  if (bits_) {
    a.ks = inputs[6].data<uint8_t>();
    a.kb = inputs[7].data<uint8_t>();
    a.vs = inputs[8].data<uint8_t>();
    a.vb = inputs[9].data<uint8_t>();
  }
  a.pool_type = pool_type(bits_ ? inputs[6].dtype() : k.dtype());
  a.B = q.shape(0);
  a.Hq = q.shape(1);
  a.N = q.shape(2);
  a.Dk = q.shape(3);
  a.Hkv = k.shape(0);
  a.Dv = bits_ ? inputs[8].shape(2) * group_size_ : v.shape(2);
  a.nb = tables.shape(1);
  a.block_size = block_size_;
  a.num_blocks = k.shape(1) / block_size_;
  a.window = window_;

  for (const auto& x : given)
    encoder.set_input_array(x);
  encoder.set_output_array(out);
  const float scale = scale_;
  const mx::Dtype dt = out.dtype();
  const void* qp = q.data<uint8_t>();
  void* op = out.data<uint8_t>();
  encoder.dispatch([a, qp, op, scale, dt]() {
    if (dt == mx::float32)
      run<float>(a, (const float*)qp, (float*)op, scale);
    else if (dt == mx::float16)
      run<mx::float16_t>(a, (const mx::float16_t*)qp, (mx::float16_t*)op, scale);
    else
      run<mx::bfloat16_t>(a, (const mx::bfloat16_t*)qp, (mx::bfloat16_t*)op, scale);
  });
}

void PagedAttention::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  throw std::runtime_error(
      "MlxqPagedAttention runs on the CPU stream only (use the Metal kernel "
      "of mlxq.worker.engine.attention on a GPU)");
}

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedAttention&>(other);
  return scale_ == o.scale_ && window_ == o.window_ &&
      block_size_ == o.block_size_ && bits_ == o.bits_ && group_size_ == o.group_size_;
}

} // namespace mlxq
