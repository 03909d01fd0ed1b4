"""Profile the engine's decode step in process (no Redis): where a step's time goes.

    python bench/profile_step.py [--batch 64] [--prompt-len 64] [--steps 40] [--cprofile]
    python bench/profile_step.py --batch 16 --shared-prefix 1024   # rows sharing a system prompt
    python bench/profile_step.py --mixed [--batch 16]
    python bench/profile_step.py --batch 64 --threads   # each thread's busy share of the steps

Prints, for ``--batch`` running sequences on the bench model: the engine's mean
wall time per decode step (tokens/s), the same forward pass alone (one
``model(...)`` + argmax, evaluated, no engine around it) as the floor, and with
``--cprofile`` the top host-side functions of the engine's steps. ``--shared-prefix P``: every row
starts with the same P-token system prompt (one request computes it first, the rows hit it in the
prefix cache and share its blocks), then its own ``--prompt-len`` tokens.

``--threads``: over the timed steps, how busy each thread of the process was (CPU seconds over wall
seconds, from ``/proc/self/task``; Linux): the main thread (builds each step's graph, schedules,
reads tokens back), MLX's CPU stream thread (runs the graph's ops), the extension pool's workers
(``mlxq-pool``: their share of the matmuls and the attention) and the BLAS's threads.

``--mixed``: should decode rows ride in a prefill pass?  With ``--batch``
decoding rows, one padded pass over prefill chunks + decode rows against a
prefill pass then a decode pass, for several chunk shapes.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import sys
import time

from mlxq.worker import blas  # noqa: E402

blas.setup()  # fast BLAS before mlx

import mlx.core as mx  # noqa: E402

from mlxq.worker.engine.api import SeqSpec  # noqa: E402
from mlxq.worker.model import load_model  # noqa: E402
from mlxq.shared.settings import Settings  # noqa: E402
from mlxq.worker.engine.engine import make_engine  # noqa: E402
from throughput import bench_model_dir, stat_cpu_seconds  # noqa: E402  (n_fork, kv_quant take it from here)


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Each thread of this process: (its name, CPU seconds so far), from /proc (Linux only)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            out[int(tid)] = (name, stat_cpu_seconds(f"/proc/self/task/{tid}/stat"))
        except OSError:  # the thread ended meanwhile
            continue
    return out


def thread_roles() -> dict[int, str]:
    """What each thread is, told apart before anything else runs MLX: the threads there now
    besides the main one are the BLAS's (blas.setup() started them at import), the one MLX's
    first evaluation adds is its CPU stream's; the extension names its pool's ``mlxq-pool``."""
    roles = {os.getpid(): "main (graph, scheduler, host)"}
    before = set(thread_cpu())
    roles.update({tid: "BLAS" for tid in before if tid not in roles})
    mx.eval(mx.array([0.0]) + 1)
    roles.update({tid: "MLX CPU stream" for tid in set(thread_cpu()) - before})
    return roles


def print_thread_shares(roles: dict[int, str], before: dict, after: dict, wall: float) -> None:
    print(f"threads over the {wall:.2f} s of steps (busy = CPU seconds / wall seconds):")
    rows = []
    for tid, (name, cpu) in after.items():
        busy = (cpu - before.get(tid, (name, 0.0))[1]) / wall
        role = roles.get(tid, "extension pool worker" if name == "mlxq-pool" else f"other ({name})")
        rows.append((busy, role, tid))
    for busy, role, tid in sorted(rows, reverse=True):
        if busy >= 0.005:
            print(f"  {role:32s} tid {tid:<8d} {busy:5.2f}")
    print(f"  {'all threads':32s} {'':12s} {sum(r[0] for r in rows):5.2f} of {os.cpu_count()} CPUs")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--shared-prefix", type=int, default=0, help="a system prompt of this many tokens "
                    "that every row starts with (prefix-cache hits, shared blocks)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--kv-mb", type=float, default=None, help="KV pool budget (default: the engine's)")
    ap.add_argument("--mixed", action="store_true", help="decode rows in the prefill pass, or not")
    ap.add_argument("--threads", action="store_true", help="each thread's busy share of the timed steps")
    args = ap.parse_args()
    roles = thread_roles() if args.threads else {}
    loaded = load_model(args.model or bench_model_dir(), cpu_weights=os.environ.get("MLXQ_CPU_WEIGHTS", "fp32"))
    model = loaded.model
    vocab = model.args.vocab_size
    rng = random.Random(0)
    system = [rng.randrange(10, vocab - 1) for _ in range(args.shared_prefix)]
    prompts = [system + [rng.randrange(10, vocab - 1) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    eng = make_engine(loaded, Settings.from_env(max_batch=args.batch, kv_memory_mb=args.kv_mb))
    if system:  # computed once, then a prefix-cache hit for every row
        eng.add([SeqSpec("system", system + [1], 1, stop_token_ids=())])
        while eng.has_work():
            eng.step()
    eng.add([SeqSpec(f"s{i}", p, args.steps + 50, stop_token_ids=()) for i, p in enumerate(prompts)])
    while eng.stats()["running"] < args.batch or any(
            s.status.value != "decode" for s in eng.scheduler.running.values()):
        eng.step()
    for _ in range(5):
        eng.step()
    if args.mixed:
        return mixed_passes(eng)
    prof = cProfile.Profile() if args.cprofile else None
    cpu0 = thread_cpu() if args.threads else {}
    t0 = time.perf_counter()
    n = 0
    if prof:
        prof.enable()
    for _ in range(args.steps):
        ev, _ = eng.step()
        n += len(ev)
    if prof:
        prof.disable()
    dt = time.perf_counter() - t0
    cpu1 = thread_cpu() if args.threads else {}
    print(f"engine: batch {args.batch}, {dt / args.steps * 1000:.1f} ms/step, {n / dt:.0f} tok/s"
          + (f" (shared prefix {args.shared_prefix}: {eng.stats().get('prefix_hit_tokens', 0)} prefix-hit tokens)"
             if system else ""))
    if args.threads:
        print_thread_shares(roles, cpu0, cpu1, dt)

    # the floor: the stock model over a dense mlx-lm cache, one step at a time, no host work
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = mx.array(prompts)
    logits = model(x, cache=cache)
    tok = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(tok)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        logits = model(tok[:, None], cache=cache)
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        mx.async_eval(tok)
    mx.eval(tok)
    dt = time.perf_counter() - t0
    print(f"dense mlx-lm cache forward+argmax alone: {dt / args.steps * 1000:.1f} ms/step, "
          f"{args.batch * args.steps / dt:.0f} tok/s")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return 0


def mixed_passes(eng) -> int:
    """One padded pass (prefill chunks + decode rows) against two passes, each evaluated."""
    from mlxq.worker.engine.kv_cache import BatchRow

    eng._settle()  # nothing in flight: the passes below run alone
    dec = list(eng.scheduler.running.values())
    drows = [BatchRow(s.block_table, s.num_computed, 1) for s in dec]
    for n_pre, width in ((8, 64), (8, 16), (4, 8), (2, 4)):
        pre = [BatchRow(eng.bm.allocate(eng.bm.blocks_needed(width)), 0, width) for _ in range(n_pre)]

        def two_passes():
            mx.eval(eng.runner.forward(pre, mx.ones((n_pre, width), mx.int32)), eng.pool.arrays())
            mx.eval(eng.runner.forward(drows, mx.ones((len(dec), 1), mx.int32)), eng.pool.arrays())

        def one_pass():
            inputs = mx.ones((n_pre + len(dec), width), mx.int32)
            last = mx.array([width - 1] * n_pre + [0] * len(dec))
            mx.eval(eng.runner.forward(pre + drows, inputs, last), eng.pool.arrays())

        times = {}
        for fn in (two_passes, one_pass, two_passes, one_pass):
            fn()
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            times.setdefault(fn.__name__, []).append((time.perf_counter() - t0) / 5)
        two, one = min(times["two_passes"]), min(times["one_pass"])
        print(f"prefill {n_pre} x {width} tokens + {len(dec)} decode rows: two passes {two * 1e3:.1f} ms, "
              f"one padded pass {one * 1e3:.1f} ms ({two / one:.2f}x)")
        for r in pre:
            eng.bm.deallocate(r.block_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
