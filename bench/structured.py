"""Structured output at batch speed: 16 JSON-schema jobs vs the same 16 unconstrained, one run.

    python bench/structured.py [--rounds 3] [--gen 128] [--jobs 16]

End to end, as ``bench/throughput.py`` runs mlxq: a producer ``Client`` -> Valkey ->
a ``python -m mlxq worker`` process (default settings) on the ``bench`` preset model
(~25M parameters, vocab 8192); a reader thread per job follows its token stream.

Both workloads use the same prompts (64 random tokens each, new ones every round; which
of the two runs second and finds them in the prefix cache alternates), greedy decoding and
``max_tokens``.  The
free jobs set ``ignore_eos``; the schema is an array of at least 1000 records (enums,
bounded integers, a nested object, arrays, short strings), so every constrained job also
generates exactly ``max_tokens`` tokens, each one under the grammar (it ends "length"
inside the array).
tok/s = generated tokens / wall time from the first submit to the last token.
Target: constrained >= 0.85x the unconstrained tokens/s.  The worker process's CPU time
per token is printed too: on a shared machine, wall-clock rounds swing with other load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path


from grammar_engines import SCHEMA as BASE_SCHEMA  # noqa: E402
from throughput import (bench_model_dir, prompts_for, read_stream, start_gateway, start_worker,  # noqa: E402
                        stat_cpu_seconds, stop, wait_http, wait_worker)
from mlxq import Client  # noqa: E402
from mlxq.shared.embedded import EmbeddedRedis  # noqa: E402
from mlxq.shared.settings import Settings  # noqa: E402

# Structure all the way: an array of records (enums, bounded integers, numbers, a nested object,
# arrays, short strings), at least 1000 of them, so every token is generated under the grammar and
# every job runs to max_tokens inside the array.
SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": BASE_SCHEMA, "minItems": 1000}},
    "required": ["records"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "article", "schema": SCHEMA}}


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time (Linux /proc; NaN elsewhere)."""
    try:
        return stat_cpu_seconds(f"/proc/{pid}/stat")
    except (OSError, ValueError, IndexError):
        return float("nan")


def run_batch(client: Client, prompts, gen: int, constrained: bool, pid: int) -> tuple[float, int, set, float]:
    """All jobs at once, a reader per job: (tok/s, tokens, finish reasons, worker CPU ms per token)."""
    cpu0 = cpu_seconds(pid)
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
    wall = max(s[2] for s in sink) - t0
    finishes = {j.result(timeout=60).finish_reason for j in jobs}
    return n / wall, n, finishes, (cpu_seconds(pid) - cpu0) * 1e3 / max(1, n)


def http_batch(base_url: str, model: str, n: int, gen: int, response_format: dict, extra: dict) -> str:
    """``n`` concurrent chat completions with the official openai client: tok/s and how many
    outputs parse as JSON, or the first error."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    http = OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)

    def one(i: int):
        r = http.chat.completions.create(model=model, max_tokens=gen, response_format=response_format, **extra,
                                         messages=[{"role": "user", "content": f"record {i}: extract the fields"}])
        text = r.choices[0].message.content or ""
        try:
            json.loads(text)
            ok = True
        except ValueError:
            ok = False
        return r.usage.completion_tokens, ok, r.choices[0].finish_reason

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(n) as pool:
            out = list(pool.map(one, range(n)))
    except Exception as exc:  # the peer's failure is the figure
        return f"failed: {type(exc).__name__}: {str(exc)[:160]}"
    wall = time.perf_counter() - t0
    toks = sum(o[0] for o in out)
    return (f"{toks / wall:7.1f} tok/s ({toks} tokens, {sum(o[1] for o in out)}/{n} parse as JSON, "
            f"finish {sorted({o[2] for o in out})})")


def no_thinking(model_dir: str) -> dict:
    """A logit_bias that keeps the model from opening a reasoning block: the bench model has the
    markers but was never trained to close one, and a constraint lets a chat answer think first."""
    vocab = json.loads(Path(model_dir, "tokenizer.json").read_text())["model"]["vocab"]
    added = {t["content"]: t["id"] for t in json.loads(Path(model_dir, "tokenizer.json").read_text())["added_tokens"]}
    tok = added.get("<think>", vocab.get("<think>"))
    return {} if tok is None else {"logit_bias": {str(tok): -100}}


def compare_peer(peer: str, redis_url: str, n: int, gen: int, model_dir: str) -> list[str]:
    """The same chat requests through mlxq's gateway and through the peer, one server at a time."""
    from openai import OpenAI

    gw, ours = start_gateway(redis_url)
    try:
        wait_http(ours, gw)
        peer_model = OpenAI(base_url=peer, api_key="bench", max_retries=0).models.list().data[0].id
        # a schema an answer can complete (the record alone), so "parses" is a figure too
        record = {"type": "json_schema", "json_schema": {"name": "record", "schema": BASE_SCHEMA, "strict": True}}
        formats = [("json_schema", record), ("json_object", {"type": "json_object"})]
        gen *= 4  # room for the record to complete
        extra = no_thinking(model_dir)
        lines = [f"{n} concurrent chat completions, max_tokens {gen}, openai client, one server at a time"
                 + (", <think> biased -100 on both" if extra else "") + ":"]
        for name, rf in formats:
            lines.append(f"  {name:12s} mlxq gateway {http_batch(ours, 'bench', n, gen, rf, extra)}")
            lines.append(f"  {name:12s} peer         {http_batch(peer, peer_model, n, gen, rf, extra)}")
        return lines
    finally:
        stop(gw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build/reuse the bench preset)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=128, help="max_tokens of every job")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--worker-blas-threads", default=None)
    ap.add_argument("--peer", metavar="URL", help="a running OpenAI-compatible peer (vllm-mlx --continuous-batching, "
                    "serving the same model directory): the same 16 chat requests go to it and to mlxq's gateway")
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
        run_batch(client, warm, 8, False, proc.pid)
        run_batch(client, warm, 8, True, proc.pid)
        peer_lines = compare_peer(args.peer, server.url, args.jobs, args.gen, model_dir) if args.peer else [
            "vllm-mlx: not compared (start it on the same model and pass --peer URL; ../shared/peers/vllm-mlx.md)"]
        for r in range(args.rounds):
            prompts = prompts_for(args.jobs, 64, vocab, seed=31 + 7919 * r)
            # the same prompts for both; who runs second (and finds the prompts cached) alternates
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                (cons if constrained else free).append(run_batch(client, prompts, args.gen, constrained, proc.pid))
            print(f"  round {r + 1}: " + "   ".join(
                f"{name} {x[0]:.1f} tok/s, {x[3]:.2f} worker CPU ms/token ({x[1]} tokens, {sorted(x[2])})"
                for name, x in (("free", free[-1]), ("json-schema", cons[-1]))), flush=True)
    finally:
        client.close()
        stop(proc)
        server.stop()
    f, c = statistics.median(x[0] for x in free), statistics.median(x[0] for x in cons)
    fc, cc = statistics.median(x[3] for x in free), statistics.median(x[3] for x in cons)
    print(f"\n{args.jobs} concurrent jobs, {args.gen} tokens each, model {model_dir}, {os.cpu_count()} cores")
    print(f"unconstrained  {f:8.1f} tok/s   {fc:6.2f} worker CPU ms/token (medians of {args.rounds})")
    print(f"json_schema    {c:8.1f} tok/s   {cc:6.2f} worker CPU ms/token (medians of {args.rounds})")
    print(f"ratio          {c / f:8.2f} tok/s (target >= 0.85); CPU per token {cc / fc:.2f}x")
    print("\n" + "\n".join(peer_lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
