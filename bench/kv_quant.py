"""Quantized KV blocks (--kv-bits 8 / 4) on the bench model, in one run:

(a) capacity: at the same --kv-memory-mb, the blocks each pool holds and how many
    sequences of --seq-len tokens fit at once, fp32 vs 8-bit vs 4-bit;
(b) decode throughput on --batch x --prompt-len-token prompts, 8-bit vs fp32 pool, one
    in-process engine each (prompts prefilled once, rounds then hit the prefix cache and
    decode; rounds alternate, best of --rounds);
(c) logits error against fp32 KV on the same prompts (teacher-forced, every position):
    our paged pool with 8 / 4-bit blocks vs mlx-lm's QuantizedKVCache (same bits and
    group size) on the stock model.

    python bench/kv_quant.py [--kv-memory-mb 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time

from mlxq.worker import blas  # noqa: E402

blas.setup()  # fast BLAS before mlx

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache  # noqa: E402

from mlxq.worker.engine import PagedEngine  # noqa: E402
from mlxq.worker.engine.attention import use_attention  # noqa: E402
from mlxq.worker.engine.api import SeqSpec  # noqa: E402
from mlxq.worker.engine.kv_cache import (BatchRow, BatchView, KVPool, make_kv_quant,  # noqa: E402
                                         make_layer_caches, probe_kv_shape)
from mlxq.worker.model import load_model  # noqa: E402
from profile_step import bench_model_dir  # noqa: E402
from throughput import prompts_for  # noqa: E402

CONFIGS = (("fp32", None), ("8-bit", 8), ("4-bit", 4))


def capacity(model, args) -> None:
    budget = int(args.kv_memory_mb * 2**20)
    per_seq = -(-(args.seq_len + 1) // 32)  # blocks of one sequence (+ its next token)
    print(f"(a) capacity at --kv-memory-mb {args.kv_memory_mb:g}, sequences of {args.seq_len} tokens")
    base = None
    for name, bits in CONFIGS:
        eng = PagedEngine(model, memory_budget_bytes=budget, kv_bits=bits, kv_group_size=args.group_size)
        blocks = eng.bm.num_blocks
        seqs = blocks // per_seq
        base = base or seqs
        print(f"    {name:6s} {blocks:6d} blocks ({eng.pool.nbytes / 2**20:6.1f} MiB pool)  "
              f"{seqs:5d} sequences  {seqs / base:.2f}x fp32")
        del eng


def _decode_round(eng, prompts, n_tokens, tag) -> float:
    """Decode tokens/s of one round: from every row's first token to the last token."""
    specs = [SeqSpec(f"{tag}-{i}", p, n_tokens, stop_token_ids=()) for i, p in enumerate(prompts)]
    eng.add(specs)
    started, count, t0 = set(), 0, None
    while eng.has_work():
        events, preempted = eng.step()
        assert not preempted, "the bench pool must hold every row"
        for e in events:
            if t0 is not None:
                count += 1
            started.add(e.uid)
        if t0 is None and len(started) == len(specs):
            t0 = time.perf_counter()
    return count / (time.perf_counter() - t0)


def throughput(model, prompts, args) -> None:
    n_blocks = 2 * len(prompts) * (-(-(args.prompt_len + args.tokens + 64) // 32))
    engines = {name: PagedEngine(model, num_blocks=n_blocks, kv_bits=bits, kv_group_size=args.group_size,
                                 pressure=1.0) for name, bits in CONFIGS[:2]}
    for name, eng in engines.items():  # prefill once: later rounds hit the prefix cache
        _decode_round(eng, prompts, 2, "warm")
    best = {name: 0.0 for name in engines}
    for r in range(args.rounds):
        for name, eng in engines.items():
            best[name] = max(best[name], _decode_round(eng, prompts, args.tokens, f"r{r}"))
    print(f"(b) decode, {len(prompts)} x {args.prompt_len}-token prompts, {args.tokens} tokens each, "
          f"best of {args.rounds} alternating rounds ({engines['fp32'].attention.name})")
    for name in engines:
        print(f"    {name:6s} {best[name]:8.1f} tok/s  {best[name] / best['fp32']:.2f}x fp32")


def _paged_logits(model, prompt, quant) -> mx.array:
    """Teacher-forced logits of the whole prompt in one pass over a fresh paged pool."""
    shape = probe_kv_shape(model)
    nb = -(-len(prompt) // 32)
    pool = KVPool(shape, nb + 1, dtype=shape.dtype, quant=quant)
    use_attention(model, pool, "auto")
    view = BatchView([BatchRow(list(range(nb)), 0, len(prompt))], scratch_block=pool.scratch_block)
    return model(mx.array([prompt]), cache=make_layer_caches(pool, view))[0].astype(mx.float32)


def _mlx_lm_logits(model, prompt, cache_cls, **kw) -> mx.array:
    cache = [cache_cls(**kw) for _ in model.layers]
    return model(mx.array([prompt]), cache=cache)[0].astype(mx.float32)


def accuracy(model, prompts, args) -> None:
    g = args.group_size
    errs: dict[str, list[tuple[float, float]]] = {}
    for prompt in prompts:
        ref = _mlx_lm_logits(model, prompt, KVCache)
        for bits in (8, 4):
            for who, logits in (("mlxq paged", _paged_logits(model, prompt, make_kv_quant(bits, g))),
                                ("mlx-lm QuantizedKVCache",
                                 _mlx_lm_logits(model, prompt, QuantizedKVCache, group_size=g, bits=bits))):
                d = mx.abs(logits - ref)
                errs.setdefault(f"{bits}-bit {who}", []).append((d.max().item(), d.mean().item()))
        fp = mx.abs(_paged_logits(model, prompt, None) - ref)
        errs.setdefault("fp32 mlxq paged", []).append((fp.max().item(), fp.mean().item()))
    print(f"(c) logits error vs fp32 KV (mlx-lm KVCache), {len(prompts)} prompts x {args.prompt_len} "
          f"teacher-forced positions, group size {g}")
    for name, vals in errs.items():
        # enough digits to compare: the two 8-bit errors differ in the fifth decimal
        print(f"    {name:34s} max-abs {max(v[0] for v in vals):.6f}  "
              f"mean-abs {sum(v[1] for v in vals) / len(vals):.7f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--kv-memory-mb", type=float, default=256.0)
    ap.add_argument("--seq-len", type=int, default=1000, help="sequence length for (a)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per row per round in (b)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--acc-prompts", type=int, default=None, help="prompts for (c) (default: all of them)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: a,b,c")
    args = ap.parse_args()
    loaded = load_model(args.model or bench_model_dir(), name="bench")
    model = loaded.model
    prompts = prompts_for(args.batch, args.prompt_len, model.args.vocab_size, seed=20)
    skip = set(args.skip.split(","))
    print(f"model {args.model or 'bench'}, {len(model.layers)} layers, kv {probe_kv_shape(model).layers[0]}")
    if "a" not in skip:
        capacity(model, args)
    if "b" not in skip:
        throughput(model, prompts, args)
    if "c" not in skip:
        accuracy(model, prompts[: args.acc_prompts], args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
