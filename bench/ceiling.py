"""How close a decode step comes to the machine: the engine against its ceilings, in one run.

    python bench/ceiling.py                          # the bench model: solo, 16 and 64 rows
    python bench/ceiling.py --shape 0.36b --batch 16 # 0.5B-class layer shapes (random weights)
    python bench/ceiling.py --e2e                    # also through Redis (a worker process, Client)
    python bench/ceiling.py --batch 64 --kv-bits 8   # the engines on 8-bit KV blocks (default fp32)

Two ceilings, measured in the same process as the engine:

* **weight-matmul-only**: every weight matrix of the model (attention and MLP projections of
  every layer, the vocabulary head) multiplied by a (batch, in) activation, nothing else, in
  one evaluated graph per step: the work a decode step cannot avoid. tokens/s = batch / time.
  Measured both ways the engine can multiply (MLX's matmul on OpenBLAS's threads, and the CPU
  extension's ``linear`` on its own pool, ``--matmul pool``), and the faster one is the ceiling.
* **memory bandwidth** (solo): a decode step at batch 1 must read every weight once; the
  machine's read bandwidth (numpy's sum, a BLAS vector-matrix product through MLX, or the CPU
  extension's one-row ``linear`` on all its threads, whichever is fastest) over the weights' bytes
  bounds solo tokens/s. It is probed over an array 4x the weights' size (what no cache holds) and
  over one of the weights' own size (what a step reads; where the weights fit in the last-level
  cache, as the bench model's 96 MiB do in a 300 MiB L3, that is the cache's read speed, and the
  engine reads its weights from there too), and the faster counts.

At batch > 1 a second line sets the engine against **the matmul ceiling plus the step's K/V
reads**: the time of the weight matmuls alone, plus every running row's keys and values (what the
attention must read once a step, at the rows' mean length over the engine's best window) at the
best read bandwidth probed. It is not the issue's figure; it says how much of the distance to the
matmul ceiling is bytes no schedule can skip (the default pool is fp32), and how much is left to
everything else (the serial ops, the host thread, the pool's waits).

Against them: the engine's steady decode (``PagedEngine.step`` in this process, rows already
decoding, every token read back by the host as the worker reads it), with the pool's weight
matmuls (``matmul=pool``, what the default ``auto`` picks on x86-64 with AVX2+FMA) and MLX's own
(``matmul=mlx``), side by side, and with ``--e2e`` the whole path (Client -> Valkey -> a
``python -m mlxq worker`` process -> token streams), generated tokens / wall time of a run long
enough that prefill is a small part.

The matmul ceilings and the engines are measured in interleaved windows of ``--steps`` steps
(``--windows`` rounds, each a window of every one of them in turn), and each figure is its best
window: the same number of chances at the same length, so a quiet or noisy spell of a shared
machine does not favour one side. An engine's every window is the same work: its rows start again
from their ``--prompt-len``-token prompts (contexts prompt + 5 to prompt + 5 + ``--steps``), and
the K/V line prints the bytes a step read. Under each figure a **paired** line: round by round, the
engine's window over that same round's ceiling (its matmul windows, or at batch 1 its bandwidth probe),
the median and the range. The figure itself (best over best) sets each side's luckiest spell against
the other's, not always the same spell; the paired median moves less from run to run and says where
the engine stands. The targets are judged on the figure. The read bandwidth is probed once at the
start and again in every window round, and the solo figure (and the K/V reads) are set against the
best probe (a single probe at the start read a slow spell once and put solo at 131% of it).

``--kv-bits 8`` (or 4): the engines store their KV blocks quantized, as ``--kv-bits`` does in the
worker; the ceilings are the same weight matmuls. At batch 64 the attention reads each row's own
K and V every step (more bytes than the weights at ~150 tokens a row, fp32), so this shows how much
of the distance to the matmul ceiling is those bytes.

``--shape 0.36b``: hidden 896, 24 layers, MLP 4864, 14 heads / 2 KV heads (Qwen2.5-0.5B's
layer shapes) and a 32000-token vocabulary, 0.36B parameters, random fp32 weights (speed does
not depend on them), built in memory.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from types import SimpleNamespace

from mlxq.worker import blas

blas.setup()  # fast BLAS before mlx

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from mlxq.shared.settings import Settings  # noqa: E402
from mlxq.worker.engine import hugepages  # noqa: E402
from mlxq.worker.engine.engine import make_engine  # noqa: E402
from mlxq.worker.engine.api import SeqSpec  # noqa: E402
from mlxq.worker.model import load_model  # noqa: E402

SHAPE_036B = dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=32000, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=4096)


def load(shape: str, model_dir: str | None):
    """The bench model from disk, or the 0.36B shape built in memory (what make_engine reads)."""
    if shape == "bench":
        from throughput import bench_model_dir

        return load_model(model_dir or bench_model_dir())
    from mlx_lm.models import qwen2

    model = qwen2.Model(qwen2.ModelArgs(**SHAPE_036B))
    mx.eval(model.parameters())
    return SimpleNamespace(name="qwen-0.36b-shape", model=model, tokenizer=None, eos_token_ids=(),
                           context_length=4096)


def weights(model) -> list[list[mx.array]]:
    """Every weight matrix a decode step multiplies by (the tied embedding once, as the head), in
    the groups the engine's pool matmuls run as one call (a layer's q/k/v, an MLP's gate/up:
    ``model_ops.GROUPS``); every other matrix alone."""
    from mlxq.worker.engine.kernels.model_ops import sibling_groups

    siblings = list(sibling_groups(model))
    grouped = {id(x) for members in siblings for x in members}
    groups = [[x.weight for x in members] for members in siblings]
    groups += [[m.weight] for _, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in grouped]
    if not any(w.shape[0] == model.args.vocab_size for g in groups for w in g):
        groups.append([model.model.embed_tokens.weight])
    return groups


def best_of(fn, rounds: int = 5, reps: int = 10) -> float:
    """Best mean seconds per call of ``fn`` over ``rounds`` rounds of ``reps`` calls."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def matmul_ceiling(groups: list[list[mx.array]], batch: int, rounds: int = 5, reps: int = 10) -> float:
    """tokens/s of the weight matmuls alone at this batch (MLX's matmul, one per matrix)."""
    mats = [w for g in groups for w in g]
    xs = [mx.random.normal((batch, w.shape[1])) for w in mats]
    mx.eval(xs)
    return batch / best_of(lambda: mx.eval([x @ w.T for x, w in zip(xs, mats)]), rounds, reps)


def _linear_ext():
    """The CPU extension when its ``linear`` is usable here, else None."""
    from mlxq.worker.engine.attention import cpu_extension
    from mlxq.worker.engine.kernels import model_ops

    try:
        ext = cpu_extension()
    except Exception:  # noqa: BLE001 - no extension here: no such ceiling
        return None
    return ext if "linear" in model_ops.checked_ops(ext) else None


def linear_ceiling(groups: list[list[mx.array]], batch: int, rounds: int = 5, reps: int = 10) -> float:
    """tokens/s of the weight matmuls alone through the CPU extension's linear (0 if unavailable),
    grouped as the engine calls them (one ``linear_group`` call for q/k/v, one for gate/up)."""
    ext = _linear_ext()
    if ext is None:
        return 0.0
    xs = [mx.random.normal((batch, g[0].shape[1])) for g in groups]
    mx.eval(xs)

    def step():
        mx.eval([ext.linear_group(x, g) if len(g) > 1 else ext.linear(x, g[0]) for x, g in zip(xs, groups)])

    return batch / best_of(step, rounds, reps)


def bandwidth(nbytes: int) -> float:
    """Read bandwidth in bytes/s over an fp32 array of about ``nbytes``: the best of numpy's sum (one
    thread), a BLAS vector-matrix product through MLX, and the CPU extension's ``linear`` of one row
    (on every thread of its pool). MLX's own reductions run slower than memory here."""
    a = np.random.default_rng(0).random(max(nbytes // 4, 1 << 22), dtype=np.float32)
    m = mx.array(a).reshape(1024, -1)
    v = mx.ones((1, 1024))
    mx.eval(m, v)
    best = min(best_of(lambda: a.sum(), reps=3), best_of(lambda: mx.eval(v @ m), reps=3))
    ext = _linear_ext()
    if ext is not None:
        w = m.reshape(-1, 1024)  # (N, 1024) rows: the same bytes as a weight matrix
        best = min(best, best_of(lambda: mx.eval(ext.linear(v, w)), reps=3))
    return a.nbytes / best


class Decoder:
    """The engine's steady decode with ``batch`` rows (in process, no Redis), in windows of steps:
    every window the same rows from the same point (``prompt_len``-token prompts, re-added, then a
    few steps until every row decodes), so that each window does the same work. (Rows that kept
    decoding across windows made each window's attention longer than the last one's, and the best
    window was mostly the first: once a later one, at twice the K/V bytes a step.) Every token is
    read back by the host as the worker reads it."""

    WARM_STEPS = 5

    def __init__(self, loaded, batch: int, prompt_len: int, steps: int, matmul: str = "pool",
                 kv_bits: int | None = None):
        vocab = loaded.model.args.vocab_size
        rng = random.Random(0)
        self.batch, self.steps = batch, steps
        self.eng = make_engine(loaded, Settings.from_env(max_batch=max(batch, 1), matmul=matmul, kv_bits=kv_bits))
        self.prompts = [[rng.randrange(10, vocab - 1) for _ in range(prompt_len)] for _ in range(batch)]
        self.round = 0
        pool = self.eng.pool  # K/V bytes a token (fp32, or quantized rows with their scales and biases)
        self.kv_per_token = pool.shape.bytes_per_block(pool.block_size, quant=pool.quant) / pool.block_size

    def _start(self) -> list[str]:
        """Add the rows (a new round of uids: the prompts' full blocks are prefix-cache hits) and step
        until every row decodes; their uids."""
        uids = [f"r{self.round}s{i}" for i in range(self.batch)]
        self.round += 1
        self.eng.add([SeqSpec(uid, p, self.steps + self.WARM_STEPS + 10, stop_token_ids=())
                      for uid, p in zip(uids, self.prompts)])
        while self.eng.stats()["running"] < self.batch or any(
                s.status.value != "decode" for s in self.eng.scheduler.running.values()):
            self.eng.step()
        for _ in range(self.WARM_STEPS):
            self.eng.step()
        return uids

    def window(self) -> tuple[float, float]:
        """tokens/s over ``steps`` steps of the rows, and the K/V bytes a step of them reads: every
        row's keys and values so far, at the rows' mean length over the window."""
        uids = self._start()
        ctx0 = self._context()
        n, t0 = 0, time.perf_counter()
        for _ in range(self.steps):
            n += len(self.eng.step()[0])
        tps = n / (time.perf_counter() - t0)
        ctx1 = self._context()
        self.eng.remove(uids)
        while self.eng.has_work():
            self.eng.step()
        return tps, (ctx0 + ctx1) / 2 * self.kv_per_token

    def _context(self) -> int:
        """Tokens in the pool over every running row (what a decode step's attention reads)."""
        return sum(s.num_computed for s in self.eng.scheduler.running.values())


def measure(models: dict, groups, batch: int, prompt_len: int, steps: int, windows: int,
            kv_bits: int | None = None, bw_probe=None) -> dict[str, float]:
    """Best tokens/s of the ceilings and the engines over ``windows`` rounds; in each round, one after
    another, a window of ``steps`` steps of each: MLX's matmuls alone, the pool's matmuls alone, the
    engine on the pool's matmuls, the engine on MLX's. Each gets the same number of windows of the
    same length, interleaved, so a quiet or a noisy spell of this machine falls on all of them.
    models: a loaded model per engine (an engine installs its matmuls into its model's layers);
    kv_bits: the engines' KV blocks (None: the model's float dtype, the default); bw_probe: a read
    bandwidth probe (bytes/s) to run in every round too, its best as "bw". "kv": the K/V bytes a
    decode step of the pool engine's best window read. "rounds": per round, the pool engine's window
    and that round's own ceiling windows (MLX's matmuls, the pool's, and the bandwidth probe), for
    the paired figure (:func:`paired_shares`)."""
    decoders = {k: Decoder(models[k], batch, prompt_len, steps, matmul=k, kv_bits=kv_bits)
                for k in ("pool", "mlx")}
    best = dict.fromkeys(("pool", "mlx", "kv"), 0.0)
    rounds = []
    for _ in range(windows):
        r = {"bw": bw_probe() if bw_probe is not None else 0.0,
             "mm": matmul_ceiling(groups, batch, rounds=1, reps=steps),
             "lin": linear_ceiling(groups, batch, rounds=1, reps=steps)}
        for k, dec in decoders.items():
            tps, kv = dec.window()
            if k == "pool":
                r["engine"] = tps
            if tps > best[k]:
                best[k] = tps
                if k == "pool":
                    best["kv"] = kv  # the K/V bytes a step of the engine's best window read
        rounds.append(r)
    best.update({key: max(r[key] for r in rounds) for key in ("bw", "mm", "lin")}, rounds=rounds)
    return best


def paired_shares(rounds: list[dict], ceiling_of) -> list[float]:
    """The engine's window over its own round's ceiling (``ceiling_of(round)``), round by round,
    sorted. The printed figure (the best window over the best) takes each side's luckiest spell,
    which need not be the same spell; a round's two windows ran a few seconds apart, so the median
    of these says where the engine stands against the ceiling more steadily from run to run."""
    return sorted(r["engine"] / c for r in rounds if (c := ceiling_of(r)) > 0)


class E2E:
    """Workers serving the bench model through one Valkey, host thread on and off (``--e2e``): each
    under its own queue name, so a round of one never runs on the other."""

    MODES = {"host thread": "1", "inline": "0"}

    def __init__(self, model_dir: str):
        from throughput import start_worker, wait_worker

        from mlxq import Client
        from mlxq.shared.embedded import EmbeddedRedis

        self.server = EmbeddedRedis().start()
        self.procs, self.clients = {}, {}
        for i, (mode, flag) in enumerate(self.MODES.items()):
            name = f"bench{i}"
            self.procs[mode] = start_worker(self.server.url, model_dir, None, [f"MLXQ_HOST_THREAD={flag}"], name)
            self.clients[mode] = Client(self.server.url, model=name)
            wait_worker(self.clients[mode], self.procs[mode], name=name)

    def run(self, batch: int, gen: int, rounds: int) -> dict[str, float]:
        """tokens/s per mode, best of ``rounds`` alternating rounds: ``batch`` jobs of ``gen`` tokens at
        once (64-token prompts)."""
        from throughput import mlxq_batch, prompts_for

        prompts = prompts_for(batch, 64, 8000, batch)
        best = dict.fromkeys(self.MODES, 0.0)
        for _ in range(rounds):
            for mode, client in self.clients.items():
                best[mode] = max(best[mode], mlxq_batch(client, prompts, gen)[0])
        return best

    def close(self) -> None:
        from throughput import stop

        for proc in self.procs.values():
            stop(proc)
        for client in self.clients.values():
            client.close()
        self.server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("bench", "0.36b"), default="bench")
    ap.add_argument("--model", help="a model directory (--shape bench; default: the bench model)")
    ap.add_argument("--batch", default="1,16,64", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=30, help="steps a window (of the engines and the ceilings)")
    ap.add_argument("--windows", type=int, default=5, help="interleaved windows of each, the best one counts")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--kv-bits", type=int, choices=(4, 8), help="the engines' KV blocks quantized (default: "
                    "fp32, as the worker's default); the ceilings are the weight matmuls either way")
    ap.add_argument("--e2e", action="store_true", help="also end to end through Redis (bench shape)")
    ap.add_argument("--e2e-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    e2e = E2E(args.model or _bench_dir()) if args.e2e and args.shape == "bench" else None
    loaded = load(args.shape, args.model)
    models = {"pool": loaded, "mlx": load(args.shape, args.model)}  # the engines side by side
    hugepages.advise(hugepages.pack(loaded.model))  # as the engine's (huge_pages): the same buffers and pages
    groups = weights(loaded.model)  # grouped as the pool's matmuls run them
    wbytes = sum(w.nbytes for g in groups for w in g)
    print(f"{loaded.name}: {sum(w.size for g in groups for w in g) / 1e6:.1f}M weight-matrix parameters "
          f"({wbytes / 2**20:.0f} MiB fp32); {blas.status()}")
    if args.kv_bits:
        print(f"engines with {args.kv_bits}-bit KV blocks (--kv-bits {args.kv_bits}; the worker's default is fp32)")
    dram, own = bandwidth(4 * wbytes), bandwidth(wbytes)
    bw = max(dram, own)
    print(f"read bandwidth {bw / 1e9:.1f} GB/s -> solo ceiling {bw / wbytes:.0f} tok/s "
          f"(over 4x the weights' bytes {dram / 1e9:.1f} GB/s, over their own bytes {own / 1e9:.1f})")
    print(f"{'batch':>5} {'ceiling':>9} {'engine':>8} {'share':>6}   engine with matmul=mlx")
    for b in (int(x) for x in args.batch.split(",")):
        got = measure(models, groups, b, args.prompt_len, args.steps, args.windows, args.kv_bits,
                      lambda: max(bandwidth(4 * wbytes), bandwidth(wbytes)))
        mm, lin, eng, eng_mlx = got["mm"], got["lin"], got["pool"], got["mlx"]
        best_bw = max(bw, got["bw"])
        # batch 1 is bound by the read bandwidth, the others by the faster of the two matmuls: the
        # figure takes the bests of the run, the paired line each round's own
        ceiling_of = (lambda r: r["bw"] / wbytes) if b == 1 else (lambda r: max(r["mm"], r["lin"]))
        ceiling = ceiling_of({"bw": best_bw, "mm": mm, "lin": lin})
        what = (f"bandwidth ceiling ({best_bw / 1e9:.1f} GB/s, best of {args.windows + 1} probes)" if b == 1
                else "matmul ceiling")
        line = (f"{b:>5} {ceiling:>9.0f} {eng:>8.0f} {eng / ceiling:>6.0%}   {eng_mlx:.0f} ({eng_mlx / ceiling:.0%})"
                f"   [{what}; matmuls alone: MLX {mm:.0f}, pool {lin:.0f}]")
        print(line, flush=True)
        if b > 1:  # what the attention cannot avoid on top: reading every row's K and V once
            floor = b / (b / ceiling + got["kv"] / best_bw)
            print(f"{'':>5} {floor:>9.0f} {eng:>8.0f} {eng / floor:>6.0%}   [matmul ceiling + the step's K/V reads "
                  f"({got['kv'] / 2**20:.0f} MiB a step) at {best_bw / 1e9:.1f} GB/s]", flush=True)
        paired = paired_shares(got["rounds"], ceiling_of)
        if paired:
            print(f"{'':>5} paired by round: median {statistics.median(paired):.0%} (range {paired[0]:.0%}-"
                  f"{paired[-1]:.0%}, {len(paired)} rounds; the engine's window over its own round's "
                  f"{'bandwidth probe' if b == 1 else 'matmul ceiling'})", flush=True)
        if e2e is not None:
            got = e2e.run(b, args.e2e_tokens if b > 1 else args.e2e_tokens // 2, args.rounds)
            print("      end to end: " + ", ".join(f"{mode} {tps:.0f} tok/s = {tps / ceiling:.0%}"
                                                    for mode, tps in got.items()), flush=True)
    if e2e is not None:
        e2e.close()
    return 0


def _bench_dir() -> str:
    from throughput import bench_model_dir

    return bench_model_dir()


if __name__ == "__main__":
    sys.exit(main())
