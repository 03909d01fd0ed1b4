"""Speculative decoding by prompt lookup (``--speculate ngram``) against the same engine without it,
in process (no Redis), on SmolLM2-135M-Instruct (the GGUF the worker serves, through its loader).

    python bench/speculative.py [--max-tokens 200] [--concurrent 16] [--rounds 2] [--always]

Extraction prompts over one ~500-token passage: "list the names in it", "copy the third paragraph",
"summarise it in your own words", each a chat job, greedy.  Printed side by side from one run:

* solo, per prompt type and over the mix: each job alone in its engine, the passage already in the
  prefix cache (a warm-up job put it there in both engines), best of ``--rounds``: seconds and
  tokens/s without and with speculation, the ratio, and the acceptance rate;
* ``--concurrent`` jobs at once (the three types in turn): tokens/s of the whole batch without and
  with, and the ratio.

The outputs of the two engines are compared token for token (greedy: they must be the same).
The step-time policy runs as it does in a worker: each engine learns its own step costs from
the warm-up on; ``--always`` takes it out (every row with a proposal speculates at every step),
which shows what the mechanism gives where the policy would say no.
"""

from __future__ import annotations

import argparse
import time

from mlxq.worker import blas

blas.setup()

from mlxq.devkit.smollm2 import INSTALL, smollm2_gguf  # noqa: E402
from mlxq.shared.settings import Settings  # noqa: E402
from mlxq.worker.engine.api import SeqSpec  # noqa: E402
from mlxq.worker.engine.engine import make_engine  # noqa: E402
from mlxq.worker.model import load_model  # noqa: E402

PASSAGE = """\
The Harbour Street library reopened on a wet Monday in March. Margaret Okafor, who had run it for
eleven years, stood at the door with a tray of tea while the first visitors shook out their
umbrellas. Among them were Daniel Reyes, a retired ferry captain, and his granddaughter Lucia, who
had come for the new reading room on the second floor.

The building had been closed for fourteen months. A burst pipe in the winter before last had
flooded the basement archive, and the council had argued for most of a year about whether to repair
the old brick hall or sell it. In the end a campaign led by the schoolteacher Tomas Berg raised
enough money to pay for new pipes, a lift, and a roof that no longer leaked over the map collection.

Inside, the shelves were arranged as they had always been: fiction on the left, local history on the
right, and the children's corner under the tall window facing the harbour. The archive had been
moved upstairs, where Priya Natarajan, the new archivist, had spent the autumn drying, sorting and
scanning more than four thousand letters, ship manifests and photographs. Visitors could now search
them on two computers by the stairs.

By noon the reading room was full. Daniel Reyes found a photograph of the ferry he had captained in
1979, and Lucia copied its caption into her notebook. Margaret Okafor said that the library had
never been so busy, and Tomas Berg promised that the next campaign would pay for longer opening
hours on Saturdays.

In the afternoon the mayor, Helen Achterberg, cut a ribbon across the stairs to the new archive and
thanked the volunteers by name: Samuel Idowu, who had carried boxes every weekend of the autumn,
Rosa Lindqvist, who had repaired the torn maps, and the twins Oskar and Frida Holm, who had typed
the catalogue of the letters. She said the council would keep the building open for as long as
people kept coming through its doors, and the room laughed when Daniel Reyes answered that he
intended to come every day.
"""
TASKS = {
    "names": "List the names of all the people mentioned in the passage above, one per line.",
    "copy": "Copy the third paragraph of the passage above exactly, word for word.",
    "summary": "Summarise the passage above in your own words, in three or four sentences.",
}


def prompt_ids(tokenizer, task: str) -> list[int]:
    messages = [{"role": "user", "content": f"{PASSAGE}\n{TASKS[task]}"}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def run_jobs(engine, specs: list[SeqSpec]) -> tuple[float, dict[str, list[int]]]:
    """Seconds from add to the last job's end, and each job's tokens."""
    out: dict[str, list[int]] = {s.uid: [] for s in specs}
    t0 = time.perf_counter()
    engine.add(specs)
    while engine.has_work():
        events, _ = engine.step()
        for e in events:
            if e.token is not None:
                out[e.uid].append(e.token)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--always", action="store_true", help="speculate at every step (no step-time policy)")
    args = ap.parse_args()
    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit(f"SmolLM2-135M-Instruct is not installed: {INSTALL}")
    loaded = load_model(str(gguf), name="smollm2")
    eos = tuple(loaded.eos_token_ids)
    prompts = {t: prompt_ids(loaded.tokenizer, t) for t in TASKS}
    engines = {mode: make_engine(loaded, Settings(speculate=mode)) for mode in ("off", "ngram")}
    if args.always:
        engines["ngram"].speculator.costs.always = True

    def spec(uid, task):
        return SeqSpec(uid, prompts[task], args.max_tokens, stop_token_ids=eos)

    for eng in engines.values():  # the passage into the prefix cache; the step costs' first samples
        run_jobs(eng, [spec("warm", "summary")])
    print(f"SmolLM2-135M-Instruct ({gguf.name}){', speculating at every step' if args.always else ''}, passage + task: "
          + ", ".join(f"{t} {len(p)} tokens" for t, p in prompts.items()) + f"; max_tokens {args.max_tokens}")
    print(f"{'solo, greedy':<16} {'tokens':>6} {'off s':>8} {'ngram s':>8} {'off tok/s':>10} {'ngram tok/s':>12} "
          f"{'ratio':>6} {'accepted':>9}")
    totals = {"off": 0.0, "ngram": 0.0}
    total_tokens = 0
    for task in TASKS:
        best, outs = {}, {}
        before = engines["ngram"].stats()
        for r in range(args.rounds):
            for mode, eng in engines.items():  # interleaved: the machine's drift hits both alike
                t, out = run_jobs(eng, [spec(f"{task}{r}", task)])
                best[mode] = min(best.get(mode, t), t)
                outs[mode] = out[f"{task}{r}"]
        after = engines["ngram"].stats()
        same = "" if outs["off"] == outs["ngram"] else "  OUTPUT DIFFERS"
        n = len(outs["off"])
        prop = after["draft_proposed"] - before["draft_proposed"]
        acc = after["draft_accepted"] - before["draft_accepted"]
        totals["off"] += best["off"]
        totals["ngram"] += best["ngram"]
        total_tokens += n
        print(f"{task:<16} {n:>6} {best['off']:>8.2f} {best['ngram']:>8.2f} {n / best['off']:>10.1f} "
              f"{n / best['ngram']:>12.1f} {best['off'] / best['ngram']:>5.2f}x "
              f"{acc / prop if prop else 0:>8.0%}{same}")
    print(f"{'mix':<16} {total_tokens:>6} {totals['off']:>8.2f} {totals['ngram']:>8.2f} "
          f"{total_tokens / totals['off']:>10.1f} {total_tokens / totals['ngram']:>12.1f} "
          f"{totals['off'] / totals['ngram']:>5.2f}x")
    tasks = list(TASKS)
    specs = {mode: [spec(f"c{i}", tasks[i % len(tasks)]) for i in range(args.concurrent)] for mode in engines}
    res = {mode: run_jobs(eng, specs[mode]) for mode, eng in engines.items()}
    n = sum(len(v) for v in res["off"][1].values())
    same = "" if res["off"][1] == res["ngram"][1] else "  OUTPUT DIFFERS"
    st = engines["ngram"].stats()
    print(f"{args.concurrent} concurrent: {n} tokens, off {res['off'][0]:.2f} s ({n / res['off'][0]:.1f} tok/s), "
          f"ngram {res['ngram'][0]:.2f} s ({n / res['ngram'][0]:.1f} tok/s): "
          f"{res['off'][0] / res['ngram'][0]:.2f}x{same}")
    print(f"ngram engine overall: {st['verify_passes']} verify passes of {st['decode_passes']} decode passes, "
          f"{st['draft_accepted']}/{st['draft_proposed']} proposed tokens accepted")


if __name__ == "__main__":
    main()
