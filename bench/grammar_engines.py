"""Which grammar engine: compile time of a realistic JSON schema and the per-token mask time.

    python bench/grammar_engines.py [--preset bench|tiny] [--rounds 5]

For each engine that installs from the package index without torch or a GPU stack
(llguidance, outlines-core; xgrammar is skipped: its wheel pulls torch, triton and
the CUDA libraries), on the tokenizer of mlxq's ``bench`` model (vocab 8192):

* compile: the schema to a ready matcher (llguidance: JSON compiler + grammar
  validation + matcher; outlines-core: schema -> regex -> token index), cold;
* mask: one token bitmask per position while walking the tokens of a valid
  instance (compact JSON, tokenized by the model's tokenizer), mean and p99 per token.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path


import numpy as np  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "category": {"enum": ["news", "sports", "science", "finance", "health"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "confidence": {"type": "number"},
        "author": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 30},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "verified": {"type": "boolean"},
            },
            "required": ["name", "age", "verified"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 5},
        "entities": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "text": {"type": "string", "maxLength": 20},
                    "kind": {"enum": ["person", "place", "org"]},
                    "count": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["text", "kind", "count"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["title", "category", "priority", "confidence", "author", "tags", "entities"],
    "additionalProperties": False,
}

INSTANCE = {
    "title": "Central bank holds rates steady",
    "category": "finance",
    "priority": 3,
    "confidence": 0.875,
    "author": {"name": "Ada Lovelace", "age": 36, "verified": True},
    "tags": ["rates", "economy", "policy"],
    "entities": [{"text": "Federal Reserve", "kind": "org", "count": 4},
                 {"text": "Washington", "kind": "place", "count": 1}],
}


def load_tokenizer(preset: str):
    from mlxq.devkit.make_model import ensure_model, seeded_dir
    from mlxq.shared.settings import cache_dir
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    d = cache_dir() / "bench-model" if preset == "bench" else seeded_dir(cache_dir(), "tiny", 0)
    path = ensure_model(d, preset, **({} if preset == "bench" else {"seed": 0}))
    return load_tokenizer(Path(path))


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def summary(name: str, compile_s: list[float], per_tok: list[float], n_tokens: int) -> None:
    per_tok = sorted(per_tok)
    p99 = per_tok[min(len(per_tok) - 1, int(0.99 * len(per_tok)))]
    print(f"{name:14s} compile median {statistics.median(compile_s) * 1e3:8.2f} ms (min "
          f"{min(compile_s) * 1e3:.2f})   mask per token mean {statistics.mean(per_tok) * 1e6:8.1f} us, "
          f"p99 {p99 * 1e6:8.1f} us   ({n_tokens} tokens)")


# ---------------------------------------------------------------- llguidance
def bench_llguidance(hf_tok, ids: list[int], rounds: int) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    lltok, t_tok = timed(lambda: llguidance.hf.from_tokenizer(hf_tok))
    print(f"llguidance {llguidance.__version__}: tokenizer built in {t_tok * 1e3:.0f} ms (once per model)")
    opts = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

    def compile_once():
        g = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=opts)
        err = llguidance.LLMatcher.validate_grammar(g)
        assert not err, err
        m = llguidance.LLMatcher(lltok, g)
        assert not m.is_error(), m.get_error()
        return m

    compile_s, per_tok = [], []
    mask = lnp.allocate_token_bitmask(1, lltok.vocab_size)
    for _ in range(rounds):
        m, dt = timed(compile_once)
        compile_s.append(dt)
        for tok in ids:
            t0 = time.perf_counter()
            lnp.fill_next_token_bitmask(m, mask)
            per_tok.append(time.perf_counter() - t0)
            assert (mask[0, tok // 32] >> (tok % 32)) & 1, "the valid instance's token is masked out"
            assert m.consume_token(tok), m.get_error()
        assert m.is_accepting()
    summary("llguidance", compile_s, per_tok, len(ids))
    batch_par(llguidance, lnp, lltok, compile_once, ids)


def batch_par(llguidance, lnp, lltok, compile_once, ids: list[int], batch: int = 16) -> None:
    """16 matchers' masks per step with fill_next_token_bitmask_par (an LLExecutor's threads)."""
    ex = llguidance.LLExecutor()
    ms = [compile_once() for _ in range(batch)]
    mask = lnp.allocate_token_bitmask(batch, lltok.vocab_size)
    per_step = []
    for tok in ids:
        t0 = time.perf_counter()
        lnp.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(ms)], mask)
        per_step.append(time.perf_counter() - t0)
        for m in ms:
            m.consume_token(tok)
    print(f"{'':14s} {batch} rows per step (fill_next_token_bitmask_par): mean "
          f"{statistics.mean(per_step) * 1e6:.1f} us per step")


# ---------------------------------------------------------------- outlines-core
def _gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def token_bytes(hf_tok) -> dict[bytes, list[int]]:
    """Each token's bytes (byte-level BPE: the GPT-2 byte alphabet mapped back)."""
    inv = {c: b for b, c in _gpt2_byte_alphabet().items()}
    out: dict[bytes, list[int]] = {}
    for tok, i in hf_tok.get_vocab().items():
        if i == hf_tok.eos_token_id:
            continue
        try:
            b = bytes(inv[c] for c in tok)
        except KeyError:  # a special token
            b = tok.encode()
        out.setdefault(b, []).append(i)
    return out


def bench_outlines(hf_tok, ids: list[int], rounds: int) -> None:
    import outlines_core as oc

    vocab = oc.Vocabulary(hf_tok.eos_token_id, token_bytes(hf_tok))
    compile_s, per_tok = [], []
    mask = np.full((1, (len(hf_tok) + 31) // 32), -1, dtype=np.int32)
    for _ in range(rounds):
        def compile_once():
            regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
            return oc.Guide(oc.Index(regex, vocab))

        guide, dt = timed(compile_once)
        compile_s.append(dt)
        for tok in ids:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.ctypes.data, mask.size, 4)
            per_tok.append(time.perf_counter() - t0)
            assert (mask[0, tok // 32] >> (tok % 32)) & 1, "the valid instance's token is masked out"
            guide.advance(tok, False)
    summary("outlines-core", compile_s, per_tok, len(ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench", choices=["bench", "tiny"])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tok = load_tokenizer(args.preset)
    hf_tok = tok._tokenizer
    ids = hf_tok.encode(json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False)
    print(f"model preset {args.preset!r}: vocab {len(hf_tok)}; the instance is {len(ids)} tokens")
    print("xgrammar: skipped (its wheel pulls torch, triton and the CUDA libraries)")
    for name, module, fn in (("llguidance", "llguidance", bench_llguidance),
                             ("outlines-core", "outlines_core", bench_outlines)):
        if importlib.util.find_spec(module) is None:
            print(f"{name}: not installed (pip install {name})")
            continue
        fn(hf_tok, ids, args.rounds)


if __name__ == "__main__":
    main()
