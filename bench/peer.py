"""mlxq's gateway next to the serving peer, vllm-mlx, on the same model and the same requests.

    python bench/peer.py [--rounds 3] [--gen 128] [--conc 16,64]

One server at a time, the same HTTP client (the official ``openai`` library, one
thread per request), the same text prompts (random 64-token texts of the model's
vocabulary, new ones every round), ``/v1/completions`` greedy with ``max_tokens``
(no ``ignore_eos``: vllm-mlx ignores it, so both sides get identical requests and
each side's tokens are counted from its ``usage``).  tok/s = completion tokens /
wall time from the first request to the last response; best of the rounds.

* **mlxq**: Valkey -> ``python -m mlxq worker`` (default settings) and ``python -m
  mlxq gateway``; the same requests also go through the Python ``Client`` (the
  producer path without HTTP), to show what the gateway costs.
* **vllm-mlx** (0.6.0, ``--continuous-batching``, in its own venv as
  ``../shared/peers/vllm-mlx.md`` says; ``--vllm-mlx PATH`` or ``~/.venvs/vllm-mlx``),
  given the same OpenBLAS mlxq loads (``LD_PRELOAD``).  When it is not installed the
  bench says so and prints mlxq's figures alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from throughput import (NEUTRAL_CWD, bench_model_dir, free_port, start_gateway, start_worker, stop, wait_http,
                        wait_worker)

from mlxq import Client
from mlxq.shared.embedded import EmbeddedRedis
from mlxq.shared.settings import Settings


def text_prompts(model_dir: str, n: int, length: int, seed: int) -> list[str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir, "tokenizer.json")))
    rng = random.Random(seed)
    special = set(tok.get_added_tokens_decoder())  # ids of the added (special) tokens
    ids = [i for i in range(tok.get_vocab_size()) if i not in special and i > 16]
    return [tok.decode([rng.choice(ids) for _ in range(length)]) for _ in range(n)]


def http_round(base: str, model: str, prompts: list[str], gen: int) -> tuple[float, int]:
    from openai import OpenAI

    http = OpenAI(base_url=base, api_key="bench", max_retries=0, timeout=900)

    def one(p: str) -> int:
        return http.completions.create(model=model, prompt=p, max_tokens=gen, temperature=0).usage.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        toks = sum(pool.map(one, prompts))
    return toks / (time.perf_counter() - t0), toks


def client_round(client: Client, prompts: list[str], gen: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    jobs = [client.submit(p, max_tokens=gen) for p in prompts]
    with ThreadPoolExecutor(len(jobs)) as pool:
        toks = sum(pool.map(lambda j: len(j.result(timeout=900).token_ids), jobs))
    return toks / (time.perf_counter() - t0), toks


def measure(label: str, fn, model_dir: str, conc: list[int], rounds: int, gen: int, out: dict) -> None:
    for c in conc:
        runs = [fn(text_prompts(model_dir, c, 64, seed=1000 * c + r), gen) for r in range(rounds)]
        out[(label, c)] = max(runs)
        print(f"  {label:14s} c{c:<3d} " + ", ".join(f"{x[0]:.1f} ({x[1]} tok)" for x in runs) + " tok/s", flush=True)


def mlxq_side(model_dir: str, conc: list[int], rounds: int, gen: int, out: dict) -> None:
    server = EmbeddedRedis().start()
    worker = start_worker(server.url, model_dir, None)
    gateway, base = start_gateway(server.url)
    client = Client(server.url, model="bench", settings=Settings(redis_url=server.url))
    try:
        wait_worker(client, worker)
        model = wait_http(base, gateway)
        http_round(base, model, text_prompts(model_dir, 4, 64, seed=7), 8)  # warm-up
        measure("mlxq gateway", lambda p, g: http_round(base, model, p, g), model_dir, conc, rounds, gen, out)
        measure("mlxq Client", lambda p, g: client_round(client, p, g), model_dir, conc, rounds, gen, out)
    finally:
        client.close()
        stop(gateway)
        stop(worker)
        server.stop()


def peer_env() -> dict:
    """The same OpenBLAS mlxq loads, preloaded under the peer's MLX (and the libraries it needs)."""
    from mlxq.worker import blas

    status = blas.setup()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if status.library:
        env["LD_PRELOAD"] = str(status.library)
        libdirs = [str(Path(blas.cache_dir()) / "blas")]
        import mlx

        libdirs += [str(p) for p in Path(mlx.__path__[0]).parent.glob("mlx*.libs")]
        env["LD_LIBRARY_PATH"] = ":".join(libdirs + [env.get("LD_LIBRARY_PATH", "")])
    return env


def peer_side(exe: Path, model_dir: str, conc: list[int], rounds: int, gen: int, out: dict) -> None:
    port = free_port()
    proc = subprocess.Popen([str(exe), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
                             "--continuous-batching", "--max-num-seqs", str(max(conc)), "--offline"],
                            env=peer_env(), cwd=NEUTRAL_CWD, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        model = wait_http(base, proc)
        http_round(base, model, text_prompts(model_dir, 4, 64, seed=7), 8)  # warm-up
        measure("vllm-mlx", lambda p, g: http_round(base, model, p, g), model_dir, conc, rounds, gen, out)
    finally:
        stop(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build/reuse the bench preset)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--conc", default="16,64", help="comma-separated concurrent request counts")
    ap.add_argument("--vllm-mlx", default=str(Path.home() / ".venvs/vllm-mlx/bin/vllm-mlx"),
                    help="the vllm-mlx executable (default: ~/.venvs/vllm-mlx/bin/vllm-mlx)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model_dir = args.model or bench_model_dir()
    conc = [int(c) for c in args.conc.split(",")]
    out: dict = {}
    print(f"model {model_dir}; {os.cpu_count()} cores; {args.rounds} rounds; /v1/completions, max_tokens {args.gen}")
    mlxq_side(model_dir, conc, args.rounds, args.gen, out)
    exe = Path(args.vllm_mlx)
    if exe.exists():
        peer_side(exe, model_dir, conc, args.rounds, args.gen, out)
    else:
        print(f"  vllm-mlx: not installed ({exe}); see ../shared/peers/vllm-mlx.md")
    print("\nbest of rounds (tok/s)")
    for c in conc:
        gw, cl = out[("mlxq gateway", c)][0], out[("mlxq Client", c)][0]
        line = f"c{c:<3d} mlxq gateway {gw:7.1f}   mlxq Client {cl:7.1f} (gateway/Client {gw / cl:.2f})"
        if ("vllm-mlx", c) in out:
            peer = out[("vllm-mlx", c)][0]
            line += f"   vllm-mlx {peer:7.1f}   gateway/vllm-mlx {gw / peer:.2f}x (target >= 2)"
        print(line)
    print(json.dumps({f"{k[0]} c{k[1]}": v[0] for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
