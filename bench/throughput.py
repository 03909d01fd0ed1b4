"""Throughput: mlxq end to end through Redis vs mlx-lm itself, side by side in one run.

    python bench/throughput.py [--model DIR] [--prompt-len 64] [--gen 128]

Measures on the same ~25M-parameter fp32 model (``mlxq make-model --preset bench``):
  * mlx-lm ``stream_generate`` solo and ``batch_generate`` at 16 and 64;
  * mlxq end to end (producer -> Valkey -> ``mlxq worker`` process -> results) at
    concurrency 1, 16 and 64.
Each pair is run in alternating rounds (mlx-lm, mlxq, mlx-lm, mlxq, ...) and the
medians are compared, so both see the same machine state; tok/s is generated
tokens / wall time from the first submit (or call) to the last result, prefill
included.  The mlxq client only waits for results (no token stream is read);
the worker still publishes every token to the job's channel and stream.  All runs are greedy on the
same prompts, so every system generates exactly the same tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlxq.worker  # noqa: E402,F401  (fast BLAS before mlx)

from mlx_lm import batch_generate, stream_generate  # noqa: E402

from mlxq import Client  # noqa: E402
from mlxq.shared.embedded import EmbeddedRedis  # noqa: E402
from mlxq.shared.settings import Settings  # noqa: E402
from mlxq.worker.model import load_model  # noqa: E402


def prompts_for(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 1) for _ in range(length)] for _ in range(n)]


def mlx_stream_solo(loaded, prompts, gen) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for p in prompts:
        for _ in stream_generate(loaded.model, loaded.tokenizer, p, max_tokens=gen):
            n += 1
    return n / (time.perf_counter() - t0), n


def mlx_batch(loaded, prompts, gen) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = batch_generate(loaded.model, loaded.tokenizer, prompts, max_tokens=gen, return_token_ids=True,
                       completion_batch_size=len(prompts))
    n = sum(len(t) for t in r.token_ids)
    return n / (time.perf_counter() - t0), n


def mlxq_e2e(client: Client, prompts, gen, concurrency: int) -> tuple[float, int]:
    """``concurrency`` jobs in flight at once until all prompts are done."""
    results = []
    lock = threading.Lock()
    todo = list(prompts)

    def runner():
        while True:
            with lock:
                if not todo:
                    return
                p = todo.pop(0)
            res = client.submit(prompt_tokens=p, max_tokens=gen, subscribe=False).result(timeout=600)
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=runner) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    bad = [r for r in results if r.finish_reason == "error"]
    if bad:
        raise RuntimeError(f"{len(bad)} jobs failed: {bad[0].error}")
    n = sum(len(r.token_ids) for r in results)
    return n / wall, n


def start_worker(url: str, model_dir: str, max_batch: int, engine: str) -> subprocess.Popen:
    env = dict(os.environ, MLXQ_LOG_LEVEL="WARNING")
    cmd = [sys.executable, "-m", "mlxq", "worker", "--redis-url", url, "--model", model_dir,
           "--name", "bench", "--max-batch", str(max_batch), "--engine", engine]
    return subprocess.Popen(cmd, env=env, cwd=str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build/reuse the bench preset)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--solo-jobs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per pair; medians are reported")
    ap.add_argument("--engine", default="dense", choices=("dense", "paged"))
    ap.add_argument("--redis-url", help="default: an embedded Valkey server")
    args = ap.parse_args()

    if args.model:
        model_dir = args.model
    else:
        from mlxq.worker.make_model import ensure_model

        cache = Path(os.environ.get("MLXQ_CACHE_DIR", Path.home() / ".cache" / "mlxq"))
        model_dir = str(ensure_model(cache / "bench-model", "bench"))
    loaded = load_model(model_dir)
    vocab = loaded.model.args.vocab_size if hasattr(loaded.model, "args") else 1000
    print(f"model {model_dir}: {loaded.num_params / 1e6:.1f}M params fp32; BLAS: {worker.BLAS_STATUS}")
    print(f"prompt {args.prompt_len} tokens, {args.gen} new tokens each, greedy; engine={args.engine}")

    server = None
    url = args.redis_url
    if not url:
        server = EmbeddedRedis().start()
        url = server.url
    proc = start_worker(url, model_dir, 64, args.engine)
    client = Client(url, model="bench", settings=Settings(redis_url=url))
    try:
        deadline = time.time() + 120
        while "bench" not in client.models():
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("the worker did not start")
            time.sleep(0.2)
        # warm-up both sides (allocations, first-call compilation)
        warm = prompts_for(4, args.prompt_len, vocab, seed=99)
        mlx_batch(loaded, warm, 8)
        mlxq_e2e(client, warm, 8, 4)

        rows = []
        solo_prompts = prompts_for(args.solo_jobs, args.prompt_len, vocab, seed=1)
        pairs = [("solo (1 at a time)", "stream_generate", solo_prompts,
                  lambda ps: mlx_stream_solo(loaded, ps, args.gen), lambda ps: mlxq_e2e(client, ps, args.gen, 1))]
        for b in (16, 64):
            pairs.append((f"concurrency {b}", f"batch_generate {b}", prompts_for(b, args.prompt_len, vocab, seed=b),
                          lambda ps: mlx_batch(loaded, ps, args.gen),
                          lambda ps, b=b: mlxq_e2e(client, ps, args.gen, b)))
        for name, ref_name, ps, ref_fn, ours_fn in pairs:
            refs, ours = [], []
            for _ in range(args.rounds):  # A/B/A/B...: both see the same machine state
                refs.append(ref_fn(ps))
                ours.append(ours_fn(ps))
            rows.append((name, ref_name, statistics.median(r[0] for r in refs),
                         statistics.median(o[0] for o in ours), refs[0][1], ours[0][1]))
            print(f"  {name}: mlx-lm {[round(r[0], 1) for r in refs]}  mlxq {[round(o[0], 1) for o in ours]}",
                  flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if server:
            server.stop()

    print()
    print(f"{'workload':<20} {'mlx-lm':<20} {'mlx-lm tok/s':>13} {'mlxq e2e tok/s':>15} {'ratio':>7}  tokens")
    for name, ref_name, ref, ours, n, m in rows:
        print(f"{name:<20} {ref_name:<20} {ref:13.1f} {ours:15.1f} {ours / ref:7.2f}  {n}/{m}")
    solo = rows[0][3]
    print()
    print(f"mlxq batch-16 end to end vs mlxq solo: {rows[1][3] / solo:.2f}x (target >= 3.4x)")
    print(f"mlxq batch-64 end to end vs mlxq solo: {rows[2][3] / solo:.2f}x")
    print("targets: solo >= 0.90x stream_generate; concurrency 16/64 >= 0.90x batch_generate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
