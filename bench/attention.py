"""Paged attention: the fused CPU op vs MLX's SDPA vs the gather path, side by side in one run.

    python bench/attention.py [--rounds 7] [--skip-engine]

1. The op alone, decode (one query per row), 8 query heads, 4 KV heads, head dim 64, fp32,
   at 1k, 4k and 16k context, against
     * ``sdpa``: ``mx.fast.scaled_dot_product_attention`` on dense K/V gathered beforehand
       (what dense mlx-lm runs);
     * ``gather+sdpa``: the paged engine's reference path, block gather then SDPA;
   reported as GB/s of K/V read, next to this machine's memory read speed measured in the
   same run (numpy max-reduce on all cores, over an array as large as the K/V and over
   512 MiB, which no cache holds).
2. The paged engine's decode step on the bench model (~25M, ``mlxq make-model --preset
   bench``) at batch 16 with ~1000-token contexts: ``attention="fused"`` vs ``"gather"``.

Rounds alternate between the contenders; medians are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

from mlxq.worker import blas  # noqa: E402

blas.setup()  # fast BLAS before mlx

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlxq.worker.engine import attention  # noqa: E402

BS = 32
HQ, HKV, D = 8, 4, 64


def timed(fn) -> float:
    t = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t


def read_speed(nbytes: int, rounds: int) -> float:
    """GB/s of a multi-threaded numpy max-reduce over ``nbytes`` (numpy drops the GIL)."""
    a = np.ones(nbytes // 4, np.float32)
    n = os.cpu_count() or 1
    parts = np.array_split(a, n)
    times = []
    for _ in range(rounds):
        threads = [threading.Thread(target=np.maximum.reduce, args=(p,)) for p in parts]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        times.append(time.perf_counter() - t)
    return a.nbytes / statistics.median(times) / 1e9


def op_case(B: int, L: int, rounds: int, op) -> dict:
    rng = np.random.default_rng(B * L)
    nb = L // BS
    num_blocks = B * nb + 8
    k_pool = mx.array(rng.standard_normal((HKV, num_blocks * BS, D), dtype=np.float32))
    v_pool = mx.array(rng.standard_normal((HKV, num_blocks * BS, D), dtype=np.float32))
    tables = mx.array(rng.permutation(num_blocks)[: B * nb].reshape(B, nb).astype(np.int32))
    kv_lens = mx.full((B,), L, mx.int32)
    q_off = kv_lens - 1
    q = mx.array(rng.standard_normal((B, HQ, 1, D), dtype=np.float32))
    heads = mx.arange(HKV)[None, :, None]

    def gather(pool):
        return pool.reshape(HKV, -1, BS, D)[heads, tables[:, None, :]].reshape(B, HKV, L, D)

    k_dense, v_dense = gather(k_pool), gather(v_pool)
    mx.eval(k_pool, v_pool, k_dense, v_dense, q)
    scale = D ** -0.5
    fns = {
        "fused": lambda: op(q, k_pool, v_pool, tables, q_off, kv_lens, scale),
        "sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k_dense, v_dense, scale=scale),
        "gather+sdpa": lambda: mx.fast.scaled_dot_product_attention(
            q, gather(k_pool), gather(v_pool), scale=scale),
    }
    for fn in fns.values():  # warm up
        mx.eval(fn())
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(timed(fn))
    kv_bytes = 2 * B * HKV * L * D * 4
    mem = read_speed(kv_bytes, rounds)
    res = {"B": B, "L": L, "kv_mb": kv_bytes / 2**20, "mem_gbs": mem}
    for k, ts in times.items():
        t = statistics.median(ts)
        res[k] = (t * 1e3, kv_bytes / t / 1e9)
    return res


def engine_decode(rounds: int, batch: int, ctx: int, steps: int) -> dict:
    from mlxq.worker.engine.api import SeqSpec
    from mlxq.devkit.make_model import ensure_model
    from mlxq.worker.model import load_model
    from mlxq.shared.settings import Settings, cache_dir
    from mlxq.worker.engine.engine import make_engine

    base = cache_dir()
    loaded = load_model(str(ensure_model(base / "bench-model", "bench")), name="bench")
    rng = np.random.default_rng(0)
    vocab = loaded.model.args.vocab_size
    prompts = [[int(t) for t in rng.integers(10, vocab, size=ctx)] for _ in range(batch)]
    gen = steps * rounds + 64  # enough for warm-up and every timed step
    # room for every row at once under the engine's admission pressure (0.85)
    need_blocks = int(batch * (-(-(ctx + gen) // BS)) / 0.8) + 16
    engines = {}
    for mode in ("fused", "gather"):
        eng = make_engine(loaded, Settings(kv_blocks=need_blocks, attention=mode, prefix_cache=False,
                                           max_batch=batch))
        eng.add([SeqSpec(f"{mode}{i}", p, gen, stop_token_ids=()) for i, p in enumerate(prompts)])
        for _ in range(10_000):  # prefill: until a step decodes every row
            events, _ = eng.step()
            if len(events) == batch:
                break
        engines[mode] = eng
    for eng in engines.values():
        for _ in range(3):
            eng.step()
    per_step = {m: [] for m in engines}
    for _ in range(rounds):
        for m, eng in engines.items():
            t = time.perf_counter()
            for _ in range(steps):
                events, preempted = eng.step()
                assert len(events) == batch and not preempted, "every row decodes each step"
            per_step[m].append((time.perf_counter() - t) / steps)
    out = {m: statistics.median(v) * 1e3 for m, v in per_step.items()}
    for eng in engines.values():
        eng.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--engine-steps", type=int, default=8, help="decode steps per timed round")
    args = ap.parse_args(argv)

    ext = attention.cpu_extension()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores; "
          f"fused op: {ext.isa()}, {ext.num_threads()} threads; mlx {mx.__version__}")
    big = read_speed(512 * 2**20, args.rounds)
    print(f"memory read speed (numpy max-reduce, all cores, 512 MiB): {big:.1f} GB/s")
    print()
    print("op alone, decode, Hq=8 Hkv=4 D=64 fp32; ms (GB/s of K/V); mem = read speed over "
          "an array of the K/V's size")
    hdr = f"{'B':>3} {'ctx':>6} {'K/V MiB':>8} {'mem GB/s':>9} | {'fused':>16} {'sdpa':>16} " \
          f"{'gather+sdpa':>16} | {'fused/mem':>9} {'vs sdpa':>8} {'vs gather':>9}"
    print(hdr)
    for B, L in ((16, 1024), (16, 4096), (4, 16384), (1, 16384)):
        r = op_case(B, L, args.rounds, ext.paged_attention)
        cells = " ".join(f"{r[k][0]:7.2f} ({r[k][1]:5.1f})" for k in ("fused", "sdpa", "gather+sdpa"))
        print(f"{B:>3} {L:>6} {r['kv_mb']:8.0f} {r['mem_gbs']:9.1f} | {cells} | "
              f"{r['fused'][1] / r['mem_gbs']:8.0%} {r['sdpa'][0] / r['fused'][0]:7.2f}x "
              f"{r['gather+sdpa'][0] / r['fused'][0]:8.2f}x")
    if not args.skip_engine:
        print()
        res = engine_decode(args.rounds, batch=16, ctx=1000, steps=args.engine_steps)
        print("paged engine decode step, bench model, batch 16, ~1000-token contexts:")
        print(f"  fused {res['fused']:.1f} ms/step, gather {res['gather']:.1f} ms/step: "
              f"fused is {res['gather'] / res['fused']:.2f}x the gather path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
