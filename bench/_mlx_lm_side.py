"""The mlx-lm side of bench/throughput.py, in its own process: mlx-lm at its best.

Started by the bench with ``MLXQ_BLAS_THREADS=default``: the same OpenBLAS is
preloaded under MLX as in the worker, but OpenBLAS keeps its own default thread
count (all cores) and nothing of mlxq runs in this process besides that preload.
Reads one JSON command per line on stdin, answers one JSON line on stdout:

    {"op": "solo",  "prompts": [[ids]], "gen": N}  -> stream_generate, one prompt after another
    {"op": "batch", "prompts": [[ids]], "gen": N}  -> batch_generate over all prompts at once
    {"op": "quit"}
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("MLXQ_BLAS_THREADS", "default")
from mlxq.worker import blas  # noqa: E402  (only the preload: mlxq.worker imports no MLX)

BLAS = blas.setup()

from mlx_lm import batch_generate, load, stream_generate  # noqa: E402


def main() -> int:
    model, tokenizer = load(sys.argv[1])
    print(json.dumps({"ready": True, "blas": str(BLAS)}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        prompts, gen = cmd["prompts"], cmd["gen"]
        t0 = time.perf_counter()
        if cmd["op"] == "solo":
            n = 0
            for p in prompts:
                for _ in stream_generate(model, tokenizer, p, max_tokens=gen):
                    n += 1
        else:
            r = batch_generate(model, tokenizer, prompts, max_tokens=gen, return_token_ids=True,
                               completion_batch_size=len(prompts))
            n = sum(len(t) for t in r.token_ids)
        wall = time.perf_counter() - t0
        print(json.dumps({"tokens": n, "wall": wall}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
