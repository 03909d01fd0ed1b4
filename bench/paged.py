"""Paged-KV engine benchmarks, each measured side by side in one run.

    python bench/paged.py memory    # concurrent sequences under one KV budget
    python bench/paged.py prefix    # RAG-like: TTFT / throughput, prefix cache on vs off
    python bench/paged.py decode    # decode tok/s at batch 16, 1k context: paged vs BatchGenerator
    python bench/paged.py latency   # longest token gap of 8 streams while a long prompt
                                    # arrives: chunked vs unchunked prefill
    python bench/paged.py all

The model is a ~25M-parameter fp32 llama (8 layers, hidden 512, GQA 8/4 heads,
vocab 8192) with random weights, built here.  Counts are kept small for a 2-core CPU (flags to scale up).
On a shared, loaded 2-core box set OPENBLAS_NUM_THREADS=1: OpenBLAS threads
fighting other processes made every matmul ~20x slower in our runs.
"""

from __future__ import annotations

from mlxq.worker import blas

blas.setup()  # optimized BLAS before mlx

import argparse
import logging
import random
import statistics
import time

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from mlxq.worker.engine.api import SeqSpec
from mlxq.worker.engine import PagedEngine
from mlxq.worker.engine.kv_cache import probe_kv_shape

VOCAB = 8192


def bench_model():
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
        num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=VOCAB,
        tie_word_embeddings=True)
    model = llama.Model(args)  # random fp32 weights
    mx.eval(model.parameters())
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"model: llama 8x512, GQA 8/4, vocab {VOCAB}, {n / 1e6:.1f}M params fp32")
    return model


def rand_tokens(rng, n):
    return [rng.randrange(VOCAB) for _ in range(n)]


# --------------------------------------------------------------------- memory
def bench_memory(model, a):
    shape = probe_kv_shape(model)
    per_token = shape.bytes_per_block(1)
    budget = a.budget_mib * 2**20
    rng = random.Random(0)
    lens = [rng.randint(50, 2000) for _ in range(200)]
    out_tokens = a.max_tokens
    # Dense (BatchKVCache): every row is padded to the longest row, in steps of 256.
    dense_n, longest = 0, 0
    for n in lens:
        longest2 = max(longest, n + out_tokens)
        rows = -(-longest2 // 256) * 256
        if (dense_n + 1) * rows * per_token > budget:
            break
        dense_n, longest = dense_n + 1, longest2
    # Paged: the engine's own admission (prompt blocks + decode reserve, 85% pressure).
    eng = PagedEngine(model, memory_budget_bytes=budget)
    eng.add([SeqSpec(f"m{i}", rand_tokens(rng, n), out_tokens) for i, n in enumerate(lens)])
    eng.scheduler.schedule_prefill()  # admission (and a plan, not run): no forward pass needed to count
    paged_n = len(eng.scheduler.running)
    # The paged sequences must also be able to finish: blocks for prompt + all output.
    paged_full = sum(-(-(lens[i] + out_tokens) // 32) for i in range(paged_n))
    print(f"[memory] KV budget {a.budget_mib} MiB ({budget // per_token} tokens), "
          f"prompts 50-2000 tokens (+{out_tokens} out)")
    print(f"  dense  (rows padded to longest): {dense_n} concurrent sequences")
    print(f"  paged  (32-token blocks, 85% pressure): {paged_n} concurrent sequences "
          f"({eng.stats()['blocks_used']}/{eng.stats()['blocks_total']} blocks; "
          f"{paged_full} blocks once all outputs are done, preemption covers the rest)")
    print(f"  ratio paged/dense: {paged_n / max(1, dense_n):.2f}x")


# --------------------------------------------------------------------- prefix
def _drive(eng, specs):
    """Add all specs at t0 and step to completion; TTFT per uid and wall time."""
    t0 = time.perf_counter()
    eng.add(specs)
    ttft, ntok = {}, 0
    while eng.has_work():
        events, pre = eng.step()
        now = time.perf_counter()
        for e in events:
            ntok += 1
            ttft.setdefault(e.uid, now - t0)
    return ttft, ntok, time.perf_counter() - t0


def bench_prefix(model, a):
    rng = random.Random(1)
    system = rand_tokens(rng, 1000)
    questions = [rand_tokens(rng, rng.randint(8, 40)) for _ in range(a.requests)]
    res = {}
    for on in (False, True):
        eng = PagedEngine(model, memory_budget_bytes=256 * 2**20, prefix_cache=on)
        _drive(eng, [SeqSpec("warm", system + rand_tokens(rng, 10), 1)])  # earlier traffic
        base_hit = eng.stats()["prefix_hit_tokens"]
        ttft_all = []
        ntok_all, wall_all = 0, 0.0
        for i, q in enumerate(questions):  # requests arrive one after another
            ttft, ntok, wall = _drive(eng, [SeqSpec(f"q{i}", system + q, a.max_tokens)])
            ttft_all.append(ttft[f"q{i}"])
            ntok_all += ntok
            wall_all += wall
        st = eng.stats()
        hit = st["prefix_hit_tokens"] - base_hit
        res[on] = (statistics.mean(ttft_all), ntok_all / wall_all)
        print(f"  prefix cache {'on ' if on else 'off'}: mean TTFT {res[on][0] * 1e3:7.1f} ms, "
              f"{res[on][1]:6.1f} tok/s, hit tokens {hit}/{sum(len(system) + len(q) for q in questions)}")
    print(f"[prefix] 1000-token system prompt + {a.requests} questions, {a.max_tokens} out each")
    print(f"  TTFT speed-up with hits: {res[False][0] / res[True][0]:.1f}x, "
          f"throughput ratio: {res[True][1] / res[False][1]:.2f}x")


# --------------------------------------------------------------------- decode
def bench_decode(model, a):
    """Both engines prefilled, then their decode steps interleaved one by one
    (so load from other processes hits both alike); medians of step times."""
    from mlx_lm.generate import BatchGenerator

    rng = random.Random(2)
    B, ctx, steps = a.batch, a.context, a.steps
    prompts = [rand_tokens(rng, ctx) for _ in range(B)]
    max_tokens = 2 * steps + 8

    gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=B,
                         prefill_batch_size=B)
    gen.insert(prompts, [max_tokens] * B)
    seen = set()
    while len(seen) < B:  # prefill until every row has its first token
        seen.update(r.uid for r in gen.next_generated())

    eng = PagedEngine(model, memory_budget_bytes=B * (ctx + max_tokens + 64) * 16 * 1024 * 2,
                      step_token_budget=4096, chunk_schedule=((None, 1024),))
    eng.add([SeqSpec(f"d{i}", p, max_tokens) for i, p in enumerate(prompts)])
    seen = set()
    while len(seen) < B:
        seen.update(e.uid for e in eng.step()[0])

    dense_t, paged_t, gather_t = [], [], []
    for _ in range(steps):
        # BatchGenerator launches its next step asynchronously: synchronize so
        # that work is charged to it and does not overlap the paged step.
        mx.synchronize()
        t0 = time.perf_counter()
        n = len(gen.next_generated())
        mx.synchronize()
        dense_t.append((time.perf_counter() - t0) / n)
        t0 = time.perf_counter()
        n = len(eng.step()[0])
        paged_t.append((time.perf_counter() - t0) / n)
        if a.profile:
            gather_t.append(_time_gathers(eng, model))
    gen.close()
    dense_tps = 1 / statistics.median(dense_t)
    paged_tps = 1 / statistics.median(paged_t)
    print(f"[decode] batch {B}, context {ctx}, {steps} interleaved steps each (median)")
    print(f"  dense (BatchGenerator): {dense_tps:7.1f} tok/s")
    print(f"  paged (PagedEngine):    {paged_tps:7.1f} tok/s")
    print(f"  ratio paged/dense: {paged_tps / dense_tps:.2f}x")
    if a.profile:
        step_s = statistics.median(paged_t) * B
        g = statistics.median(gather_t)
        print(f"  profile: paged decode step {step_s * 1e3:.1f} ms, of which K/V scatter + "
              f"block gathers {g * 1e3:.1f} ms ({g / step_s:.0%}); dense step "
              f"{statistics.median(dense_t) * B * 1e3:.1f} ms")


def _time_gathers(eng, model) -> float:
    """Decode-forward seconds saved when the K/V block gathers are skipped:
    the same forward over the same batch, once on the paged caches and once on
    caches that hand back pre-gathered contiguous K/V (what dense slices give)."""
    from mlxq.worker.engine.kv_cache import BatchRow, BatchView, PagedLayerCache, make_layer_caches

    class _Pregathered(PagedLayerCache):
        def update_and_fetch(self, keys, values):
            return self.kv

    rows = [s for s in eng.scheduler.running.values() if s.status.value == "decode"]
    view = BatchView([BatchRow(s.block_table, s.num_computed, 1) for s in rows])
    inputs = mx.array([[s.tokens[-1]] for s in rows])
    paged = make_layer_caches(eng.pool, view)
    pre = []
    for c in paged:
        p = _Pregathered(eng.pool, c.layer, view)
        p.kv = c.gathered()
        mx.eval(p.kv)
        pre.append(p)
    times = {}
    for name, caches in (("paged", paged), ("pre", pre)):
        t0 = time.perf_counter()
        mx.eval(model(inputs, cache=caches), eng.pool.arrays())
        times[name] = time.perf_counter() - t0
    # (the paged forward rewrote each row's current slot with the same values)
    return times["paged"] - times["pre"]


# --------------------------------------------------------------------- latency
def bench_latency(model, a):
    rng = random.Random(3)
    streams = [rand_tokens(rng, 64) for _ in range(8)]
    long_prompt = rand_tokens(rng, a.long_prompt)
    res = {}
    for chunked in (False, True):
        eng = PagedEngine(model, memory_budget_bytes=256 * 2**20, chunked_prefill=chunked,
                          step_token_budget=a.step_budget)
        eng.add([SeqSpec(f"s{i}", p, 10_000) for i, p in enumerate(streams)])
        for _ in range(4):
            eng.step()
        last = {f"s{i}": time.perf_counter() for i in range(8)}
        eng.add([SeqSpec("long", long_prompt, 4)])
        gaps, first_long = [], None
        t0 = time.perf_counter()
        while first_long is None or time.perf_counter() - first_long < 0.2:
            events, _ = eng.step()
            now = time.perf_counter()
            for e in events:
                if e.uid == "long":
                    first_long = first_long or now
                elif e.uid in last:
                    gaps.append(now - last[e.uid])
                    last[e.uid] = now
        res[chunked] = (max(gaps), first_long - t0)
        eng.remove([f"s{i}" for i in range(8)] + ["long"])
        print(f"  {'chunked  ' if chunked else 'unchunked'}: longest stream gap "
              f"{res[chunked][0] * 1e3:7.1f} ms, long prompt TTFT {res[chunked][1] * 1e3:7.1f} ms")
    print(f"[latency] {a.long_prompt}-token prompt arriving while 8 sequences stream "
          f"(step token budget {a.step_budget})")
    print(f"  longest-gap ratio unchunked/chunked: {res[False][0] / res[True][0]:.1f}x")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("which", choices=["memory", "prefix", "decode", "latency", "all"])
    p.add_argument("--budget-mib", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--long-prompt", type=int, default=2000)
    p.add_argument("--step-budget", type=int, default=512, help="latency: tokens per step")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = bench_model()
    for name, fn in [("memory", bench_memory), ("prefix", bench_prefix),
                     ("decode", bench_decode), ("latency", bench_latency)]:
        if a.which in (name, "all"):
            fn(model, a)


if __name__ == "__main__":
    main()
