"""n > 1 in the engine, in process (no Redis): n samples forked off one prefill against n = 1.

    python bench/n_fork.py [--n 8] [--prompt-len 1000] [--max-tokens 128] [--rounds 3]

Prints, on the bench model, the wall time of one job to its last token: n = 1, n samples that
fork off sample 0 (one prefill of the prompt, shared blocks), and n independent copies (each
prefills the prompt), best of ``--rounds``; the issue's figure is forked n / n = 1 (<= 1.3x).
Then the ratio's anatomy from the same best rounds: each job's time to its first token (the
prefill, shared by the n samples) and its mean decode step after it, and the decode step that
forked n would need for 1.3x, and the weight matmuls and the attention alone at one row and at n
forked rows (what part of the step's extra cost each is). ``fork_timings`` is the same measurement for other scripts.
"""

from __future__ import annotations

import argparse
import random
import time

from profile_step import bench_model_dir  # noqa: E402  (sets up the fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
from ceiling import linear_ceiling, weights  # noqa: E402
from mlxq.shared.settings import Settings  # noqa: E402
from mlxq.worker.engine.engine import make_engine  # noqa: E402
from mlxq.worker.engine.api import SeqSpec  # noqa: E402
from mlxq.worker.model import load_model  # noqa: E402


def job_specs(uid: str, prompt: list[int], n: int, max_tokens: int, fork: bool) -> list[SeqSpec]:
    """One job's sequences as the worker builds them (greedy, no EOS: every sample runs max_tokens)."""
    if n == 1:
        return [SeqSpec(uid, prompt, max_tokens, stop_token_ids=())]
    return [SeqSpec(f"{uid}#{i}", prompt, max_tokens, stop_token_ids=(),
                    fork_of=f"{uid}#0" if fork and i else None, fork_len=len(prompt) if fork else 0)
            for i in range(n)]


def time_job(engine, specs: list[SeqSpec]) -> tuple[float, float]:
    """Seconds from add to the job's last token, and to its first (the prefill's share)."""
    t0 = time.perf_counter()
    first = None
    engine.add(specs)
    while engine.has_work():
        events, _ = engine.step()
        if first is None and events:
            first = time.perf_counter() - t0
    return time.perf_counter() - t0, first or 0.0


def attention_alone(engine, specs: list[SeqSpec], steps: int = 20, reps: int = 40) -> float:
    """Median seconds of one decode step's attention calls (every layer's), run again on their own:
    the job decodes ``steps`` steps, the next step's calls are recorded with their inputs (the pool
    arrays, tables, lengths), timed, and the job is removed."""
    engine.add(specs)
    for _ in range(steps):
        engine.step()
    pool = engine.pool
    op, calls = pool.attention, []

    def record(*a, **kw):
        calls.append((a, kw))
        return op(*a, **kw)

    pool.attention = record
    try:
        engine.step()
    finally:
        pool.attention = op
    layers = len(pool.shape.layers)
    calls = calls[-layers:]

    def once():
        mx.eval([op(*a, **kw) for a, kw in calls])

    once()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        ts.append(time.perf_counter() - t0)
    del calls  # the pool arrays again written in place
    engine.remove([s.uid for s in specs])
    while engine.has_work():
        engine.step()
    return sorted(ts)[reps // 2]


def fork_timings(loaded, n: int = 8, prompt_len: int = 1000, max_tokens: int = 128, rounds: int = 3,
                 settings: Settings | None = None) -> dict:
    """Best-of-rounds seconds for "n1", "forked" (n samples, one prefill) and "copies" (n unforked),
    each round on fresh prompts (no prefix-cache hits), after one warm-up job; "<kind>_first": the
    seconds to the first token in that best round; "n1_attention", "forked_attention": a decode
    step's attention alone (attention_alone), once each at the end."""
    engine = make_engine(loaded, settings or Settings.from_env(max_batch=n))
    vocab = loaded.model.args.vocab_size
    rng = random.Random(0)

    def prompt():
        return [rng.randrange(10, vocab - 1) for _ in range(prompt_len)]

    time_job(engine, job_specs("warm", prompt(), n, 8, True))
    best = {"n1": float("inf"), "forked": float("inf"), "copies": float("inf")}
    for r in range(rounds):
        for kind, k, fork in (("n1", 1, False), ("forked", n, True), ("copies", n, False)):
            specs = job_specs(f"{kind}{r}", prompt(), k, max_tokens, fork)
            total, first = time_job(engine, specs)
            if total < best[kind]:
                best[kind], best[kind + "_first"] = total, first
    best["fork_shared_tokens"] = engine.stats()["fork_shared_tokens"]
    for kind, k, fork in (("n1", 1, False), ("forked", n, True)):
        best[kind + "_attention"] = attention_alone(engine, job_specs(f"{kind}-attn", prompt(), k, max_tokens, fork))
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    loaded = load_model(args.model or bench_model_dir())
    t = fork_timings(loaded, args.n, args.prompt_len, args.max_tokens, args.rounds)
    print(f"{args.prompt_len}-token prompt, max_tokens {args.max_tokens}, best of {args.rounds}:")
    print(f"  n=1                   {t['n1']:.3f} s")
    print(f"  n={args.n} forked (one prefill) {t['forked']:.3f} s  = {t['forked'] / t['n1']:.2f}x n=1"
          " (target <= 1.3x)")
    print(f"  n={args.n} unforked copies   {t['copies']:.3f} s  = {t['copies'] / t['n1']:.2f}x n=1")
    # The ratio's anatomy: (first + steps * step) / (first1 + steps * step1). The prefill is shared,
    # so the figure turns on what a decode step of n rows costs beyond one row.
    steps = args.max_tokens - 1
    step1, stepn = ((t[k] - t[k + "_first"]) / steps for k in ("n1", "forked"))
    budget = (1.3 * t["n1"] - t["forked_first"]) / steps
    print(f"  to the first token: n=1 {t['n1_first']:.3f} s, forked {t['forked_first']:.3f} s; then a decode step: "
          f"n=1 {step1 * 1e3:.2f} ms, forked {stepn * 1e3:.2f} ms = {stepn / step1:.2f}x "
          f"(1.3x n=1 would need <= {budget * 1e3:.2f} ms)")
    # Of that step, the weight matmuls alone (the extension's linear, as the engine groups them; 0 where
    # it does not run): one row is bound by reading the weights, n rows add their multiply-adds.
    groups = weights(loaded.model)
    mm1, mmn = (k / tps if (tps := linear_ceiling(groups, k)) else 0.0 for k in (1, args.n))
    if mm1:
        print(f"  the weight matmuls alone (best of 5): 1 row {mm1 * 1e3:.2f} ms, {args.n} rows {mmn * 1e3:.2f} ms "
              f"(+{(mmn - mm1) * 1e3:.2f} ms of the step's +{(stepn - step1) * 1e3:.2f} ms)")
    a1, an = t["n1_attention"], t["forked_attention"]
    print(f"  a decode step's attention alone (every layer, median of 40): n=1 {a1 * 1e3:.2f} ms, forked "
          f"{an * 1e3:.2f} ms (+{(an - a1) * 1e3:.2f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
