"""``n`` samples of one prompt vs one sample, end to end through Redis.

    python bench/n_samples.py             # 3 alternating rounds (~3-6 min on 2 shared cores)
    python bench/n_samples.py --quick     # 2 rounds, 64 new tokens

One ``python -m mlxq worker`` on the bench model (``mlxq make-model --preset bench``), a producer
``Client`` reading every token delta, and per round, each on a fresh ~1000-token prompt (no prefix
cache hit from an earlier workload) with the same ``max_tokens`` (``ignore_eos``: every sample
generates exactly that many):

* ``n=1``: one job;
* ``n=8``: one job with ``n=8`` (its samples share the prompt's KV when the engine forks them);
* ``8 jobs``: eight separate ``n=1`` jobs of one prompt at once, for contrast.

It prints each round's wall times (first submit to the last token), the medians, the ratio
``n=8 / n=1`` (the issue's target: <= 1.3) and the prompt tokens the worker's engine prefilled for
each workload (from its stats: ``prompt_tokens - prefix_hit_tokens``; one prefill for ``n=8`` shows
as ~1000, a prefill per sample as ~8000), which tells whether the engine forked the samples.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

from mlxq import Client
from mlxq.shared import codec
from mlxq.shared.embedded import EmbeddedRedis
from mlxq.shared.settings import Settings
from throughput import bench_model_dir, prompts_for, start_worker, stop, wait_worker


def drain(job, sink: list, i: int) -> None:
    """Read a job's stream to its end (every sample's); its token count and the time it ended."""
    n = 0
    for d in job.stream(timeout=900):
        if d.finish_reason == "error":
            raise RuntimeError(f"job failed: {d.error}")
        n += len(d.token_ids)
    sink[i] = (n, time.perf_counter())


def run_jobs(client: Client, specs: list[dict]) -> tuple[float, int]:
    """Submit every spec at once, read each stream on its own thread: (wall seconds, tokens)."""
    sink: list = [None] * len(specs)
    t0 = time.perf_counter()
    jobs = [client.submit(**s) for s in specs]
    threads = [threading.Thread(target=drain, args=(j, sink, i)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(s is None for s in sink):
        raise RuntimeError("a job's stream did not end")
    return max(s[1] for s in sink) - t0, sum(s[0] for s in sink)


def engine_counters(client: Client) -> dict[str, int]:
    """The worker's engine counters (its last published stats)."""
    k = client.queue_for("bench").keys
    out: dict[str, int] = {}
    for wid in client.redis.zrange(k.workers, 0, -1):
        raw = client.redis.hget(k.worker(wid.decode()), "s")
        snap = codec.unpack(raw) if raw else {}
        for name in ("engine_prompt_tokens", "engine_prefix_hit_tokens"):
            out[name] = out.get(name, 0) + int(snap.get(name, 0))
    return out


def prefilled(client: Client, before: dict[str, int]) -> int:
    time.sleep(1.0)  # the worker publishes its stats right after a job ends; give it that moment
    after = engine_counters(client)
    return ((after.get("engine_prompt_tokens", 0) - before.get("engine_prompt_tokens", 0))
            - (after.get("engine_prefix_hit_tokens", 0) - before.get("engine_prefix_hit_tokens", 0)))


NAMES = ("n=1", "n=8", "8 jobs")


def workloads(prompt: list[int], gen: int) -> dict[str, list[dict]]:
    one = dict(prompt_tokens=prompt, max_tokens=gen, ignore_eos=True, temperature=0.8, seed=11)
    return {"n=1": [one], "n=8": [dict(one, n=8)], "8 jobs": [dict(one, seed=11 + i) for i in range(8)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build/reuse the bench preset)")
    ap.add_argument("--quick", action="store_true", help="2 rounds, 64 new tokens")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3)")
    ap.add_argument("--prompt-len", type=int, default=1000, help="prompt tokens (default 1000)")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per sample (default 128)")
    ap.add_argument("--redis-url", help="default: an embedded Valkey server")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rounds = args.rounds or (2 if args.quick else 3)
    gen = args.max_tokens or (64 if args.quick else 128)
    model_dir = args.model or bench_model_dir()
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    server = None if args.redis_url else EmbeddedRedis().start()
    url = args.redis_url or server.url
    proc = start_worker(url, model_dir, None)
    client = Client(url, model="bench", settings=Settings(redis_url=url))
    times: dict[str, list[float]] = {}
    fills: dict[str, list[int]] = {}
    try:
        wait_worker(client, proc)
        run_jobs(client, workloads(prompts_for(1, 64, vocab, seed=99)[0], 8)["n=8"])  # warm-up
        print(f"model {model_dir}; prompt {args.prompt_len} tokens, {gen} new tokens per sample; {rounds} rounds")
        for r in range(rounds):
            prompts = prompts_for(3, args.prompt_len, vocab, seed=1000 + r)  # fresh prompts: no prefix hit
            for name, prompt in zip(NAMES, prompts):
                specs = workloads(prompt, gen)[name]
                before = engine_counters(client)
                wall, tokens = run_jobs(client, specs)
                fill = prefilled(client, before)
                times.setdefault(name, []).append(wall)
                fills.setdefault(name, []).append(fill)
                print(f"  round {r + 1} {name:7s} {wall:7.3f} s  {tokens:5d} tokens  {tokens / wall:7.1f} tok/s  "
                      f"prefilled {fill} prompt tokens", flush=True)
        med = {name: statistics.median(v) for name, v in times.items()}
        print("medians: " + ", ".join(f"{name} {t:.3f} s" for name, t in med.items()))
        print(f"n=8 / n=1 = {med['n=8'] / med['n=1']:.2f}x (target <= 1.3x); "
              f"8 jobs / n=1 = {med['8 jobs'] / med['n=1']:.2f}x")
        forked = statistics.median(fills["n=8"]) < 1.5 * args.prompt_len
        print("prefilled per workload (median): "
              + ", ".join(f"{name} {int(statistics.median(v))}" for name, v in fills.items())
              + ("; n=8 prefilled once: the engine forked its samples" if forked else
                 "; n=8 prefilled each sample: this engine does not fork them"))
    finally:
        client.close()
        stop(proc)
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
