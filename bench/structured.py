"""Structured output at batch speed: 16 JSON-schema jobs vs the same 16 unconstrained, one run.

    python bench/structured.py [--rounds 3] [--gen 128] [--jobs 16]

End to end, as ``bench/throughput.py`` runs mlxq: a producer ``Client`` -> Valkey ->
a ``python -m mlxq worker`` process (default settings) on the ``bench`` preset model
(~25M parameters, vocab 8192); a reader thread per job follows its token stream.

Both workloads use the same prompts (64 random tokens each, new ones every round; which
of the two runs second and finds them in the prefix cache alternates), greedy decoding and
``max_tokens``.  The
free jobs set ``ignore_eos``; the schema's last field is a string with a large
``minLength``, so every constrained job also generates exactly ``max_tokens`` tokens
(it ends "length" inside that string, after the schema's enums, bounded integers,
nested object and arrays).  
tok/s = generated tokens / wall time from the first submit to the last token.
Target: constrained >= 0.85x the unconstrained tokens/s.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.grammar_engines import SCHEMA as BASE_SCHEMA  # noqa: E402
from bench.throughput import bench_model_dir, prompts_for, read_stream, start_worker, wait_worker  # noqa: E402
from mlxq import Client  # noqa: E402
from mlxq.shared.embedded import EmbeddedRedis  # noqa: E402
from mlxq.shared.settings import Settings  # noqa: E402

SCHEMA = {
    **BASE_SCHEMA,
    "properties": {**BASE_SCHEMA["properties"], "body": {"type": "string", "minLength": 2000}},
    "required": BASE_SCHEMA["required"] + ["body"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "article", "schema": SCHEMA}}


def run_batch(client: Client, prompts, gen: int, constrained: bool) -> tuple[float, int, set]:
    """All jobs at once, a reader per job: (tok/s, tokens, finish reasons)."""
    kw = dict(response_format=FORMAT) if constrained else dict(ignore_eos=True)
    sink: list = [None] * len(prompts)
    t0 = time.perf_counter()
    jobs = [client.submit(prompt_tokens=p, max_tokens=gen, **kw) for p in prompts]
    threads = [threading.Thread(target=read_stream, args=(j, sink, i, t0)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n = sum(len(s[0]) for s in sink)
    finishes = {j.result(timeout=60).finish_reason for j in jobs}
    return n / (max(s[2] for s in sink) - t0), n, finishes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build/reuse the bench preset)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=128, help="max_tokens of every job")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--worker-blas-threads", default=None)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model_dir = args.model or bench_model_dir()
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    server = EmbeddedRedis().start()
    proc = start_worker(server.url, model_dir, args.worker_blas_threads)
    client = Client(server.url, model="bench", settings=Settings(redis_url=server.url))
    free, cons = [], []
    try:
        wait_worker(client, proc)
        warm = prompts_for(4, 64, vocab, seed=99)
        run_batch(client, warm, 8, False)
        run_batch(client, warm, 8, True)
        for r in range(args.rounds):
            prompts = prompts_for(args.jobs, 64, vocab, seed=31 + 7919 * r)
            # the same prompts for both; who runs second (and finds the prompts cached) alternates
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                (cons if constrained else free).append(run_batch(client, prompts, args.gen, constrained))
            print(f"  round {r + 1}: free {free[-1][0]:.1f} tok/s ({free[-1][1]} tokens, {sorted(free[-1][2])}), "
                  f"json-schema {cons[-1][0]:.1f} tok/s ({cons[-1][1]} tokens, {sorted(cons[-1][2])})", flush=True)
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        server.stop()
    f, c = statistics.median(x[0] for x in free), statistics.median(x[0] for x in cons)
    print(f"\n{args.jobs} concurrent jobs, {args.gen} tokens each, model {model_dir}")
    print(f"unconstrained  {f:8.1f} tok/s (median of {args.rounds})")
    print(f"json_schema    {c:8.1f} tok/s (median of {args.rounds})")
    print(f"ratio          {c / f:8.2f}  (target >= 0.85)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
