"""A draft model's speculation (``--speculate draft``) shown on a pair of random-weight models that
share a vocabulary, in process (no Redis): no real small model of SmolLM2's tokenizer is on this
machine, so this shows the mechanism and its acceptance rate, not a speed-up to expect.

    python bench/draft_model.py [--jobs 16] [--gen 64] [--prompt-len 64]

The target is the bench model (``mlxq make-model --preset bench``: ~25M parameters, 4 training
steps, so its weights are close to random); the drafts are (a) the target's own weights, whose
greedy proposals are all accepted (the verify pass at its best), and (b) a 2-layer random llama of
the same vocabulary (hidden 64), whose proposals mostly are not.  Greedy, EOS ignored, every row
speculating at every step (the step-time policy out of the way: it would switch a poor draft off).
For each draft, solo (2 jobs one after another) and ``--jobs`` at once: seconds without and with,
the ratio, the accepted share of the proposed tokens, and whether the output is the one without
speculation (it must be).
"""

from __future__ import annotations

import argparse
import sys

from mlxq.worker import blas

blas.setup()

import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from mlxq.worker.engine import PagedEngine  # noqa: E402
from mlxq.worker.engine.api import SeqSpec  # noqa: E402
from mlxq.worker.model import load_model  # noqa: E402
from profile_step import bench_model_dir  # noqa: E402
from speculative import run_jobs  # noqa: E402
from throughput import prompts_for  # noqa: E402


def small_random(vocab: int, seed: int = 9):
    """A 2-layer llama with random weights and ``vocab`` tokens, evaluated."""
    mx.random.seed(seed)
    m = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab, tie_word_embeddings=False))
    mx.eval(m.parameters())
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=16, help="jobs at once in the batched run")
    ap.add_argument("--gen", type=int, default=64, help="new tokens a job")
    ap.add_argument("--prompt-len", type=int, default=64)
    args = ap.parse_args()
    target = load_model(bench_model_dir(), name="bench").model
    vocab = target.args.vocab_size
    drafts = {"own weights": target, "small random": small_random(vocab)}
    blocks = 2 * args.jobs * -(-(args.prompt_len + args.gen + 16) // 32)

    def engine(draft=None) -> PagedEngine:
        if draft is None:
            return PagedEngine(target, num_blocks=blocks)
        eng = PagedEngine(target, num_blocks=blocks, speculate="draft", draft=draft)
        eng.speculator.costs.always = True
        return eng

    def specs(tag: str, prompts) -> list[SeqSpec]:
        return [SeqSpec(f"{tag}{i}", p, args.gen, stop_token_ids=()) for i, p in enumerate(prompts)]

    work = {"solo": prompts_for(2, args.prompt_len, vocab, seed=71),
            "batch": prompts_for(args.jobs, args.prompt_len, vocab, seed=72)}

    def timed(eng, name: str) -> tuple[float, dict]:
        if name == "solo":  # one after another
            secs, out = 0.0, {}
            for s in specs("s", work["solo"]):
                t, o = run_jobs(eng, [s])
                secs, out = secs + t, {**out, **o}
            return secs, out
        return run_jobs(eng, specs("b", work["batch"]))

    warm = prompts_for(2, 16, vocab, seed=70)
    print(f"target: the bench model ({vocab} tokens, {len(target.layers)} layers); {args.gen} new tokens a job, "
          f"{args.prompt_len}-token random prompts; every row speculating at every step")
    print(f"{'draft':<14} {'workload':<10} {'off s':>7} {'draft s':>8} {'ratio':>6} {'accepted':>9}")
    for label, draft in drafts.items():
        for name in ("solo", "batch"):
            off, on = engine(), engine(draft)
            for eng in (off, on):
                run_jobs(eng, specs("w", warm))
            before = on.stats()
            t_off, out_off = timed(off, name)
            t_on, out_on = timed(on, name)
            st = on.stats()
            prop = st["draft_proposed"] - before["draft_proposed"]
            acc = st["draft_accepted"] - before["draft_accepted"]
            same = "" if out_off == out_on else "  OUTPUT DIFFERS"
            wl = "solo" if name == "solo" else f"{args.jobs} at once"
            print(f"{label:<14} {wl:<10} {t_off:7.2f} {t_on:8.2f} {t_off / t_on:5.2f}x "
                  f"{acc / prop if prop else 0:8.0%}  ({acc}/{prop} proposed tokens accepted){same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
