"""llama.cpp's side of bench/llamacpp.py: one measurement in a process of its own, run by the
``llama-cpp-python`` venv's interpreter (../shared/peers/llama-cpp.md), never mlxq's.

    python _llamacpp_side.py < REQUEST_JSON

The request (on stdin): {"op": "probe" | "solo" | "prompt" | "batch", "model": GGUF path, "threads": n,
"prompts": [[token ids], ...], "gen": n, "extra_bufts": bool}. Prints one JSON line: {"tokens",
"wall", "api"} (batch: and "token_ids", each sequence's greedy tokens). ``extra_bufts``: llama.cpp's extra buffer types (weight repacking, AMX tiles), its
default; the build on the bench machine of 2026-12-01 crashed in its first decode with them
(use_extra_bufts, a model parameter the high-level API does not expose), so the bench probes first.

* probe: one short eval, to see whether this build runs with these settings.

* solo: the high-level API, ``Llama.generate(tokens, temp=0.0)`` one prompt after another, ``gen``
  tokens each (generate never stops at EOS by itself), after a warm-up call; tokens = generated,
  wall = from the first prompt to the last token, prefill included (mlxq's solo measure).
* prompt: ``Llama.eval`` of each prompt after ``reset()``; tokens = prompt tokens.
* batch: the low-level API, every prompt its own sequence id in one ``llama_batch``: the prompts
  prefilled together, then each step one token of every sequence in one ``llama_decode``, greedy
  (argmax of each row's logits); tokens = generated, wall = from the first decode to the last token.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def _model_params(extra_bufts: bool):
    """llama.cpp's default model parameters with use_extra_bufts as asked; also what the high-level
    API's Llama gets (it reads the defaults from llama_cpp.llama_cpp and sets no such field)."""
    import llama_cpp.llama_cpp as raw

    default = getattr(raw, "_mlxq_default_params", raw.llama_model_default_params)
    raw._mlxq_default_params = default

    def params():
        p = default()
        p.use_extra_bufts = extra_bufts
        return p

    raw.llama_model_default_params = params
    return params()


def _llama(req: dict, n_ctx: int):
    _model_params(req.get("extra_bufts", True))
    from llama_cpp import Llama

    return Llama(model_path=req["model"], n_ctx=n_ctx, n_threads=req["threads"], n_threads_batch=req["threads"],
                 verbose=False)


def probe(req: dict) -> dict:
    llm = _llama(req, 256)
    t0 = time.perf_counter()
    llm.eval(req["prompts"][0][:4])
    return {"tokens": 4, "wall": time.perf_counter() - t0, "api": "Llama.eval"}


def solo(req: dict) -> dict:
    llm = _llama(req, 2048)
    gen = req["gen"]

    def one(tokens: list[int]) -> int:
        n = 0
        for _ in llm.generate(tokens, temp=0.0, reset=True):
            n += 1
            if n == gen:
                break
        return n

    one(req["prompts"][0][:8])  # warm-up
    t0 = time.perf_counter()
    n = sum(one(p) for p in req["prompts"])
    return {"tokens": n, "wall": time.perf_counter() - t0, "api": "Llama.generate"}


def prompt(req: dict) -> dict:
    longest = max(len(p) for p in req["prompts"])
    llm = _llama(req, max(2048, longest + 16))
    llm.eval(req["prompts"][0][:16])  # warm-up
    wall = n = 0
    for p in req["prompts"]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(p)
        wall += time.perf_counter() - t0
        n += len(p)
    return {"tokens": n, "wall": wall, "api": "Llama.eval"}


def batch(req: dict) -> dict:
    import llama_cpp as L

    prompts, gen, threads = req["prompts"], req["gen"], req["threads"]
    n_seq = len(prompts)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(req["model"].encode(), _model_params(req.get("extra_bufts", True)))
    if not model:
        raise SystemExit(f"llama.cpp could not load {req['model']}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    prefill = sum(len(p) for p in prompts)
    params = L.llama_context_default_params()
    params.n_ctx = prefill + n_seq * (gen + 8)
    params.n_batch = params.n_ubatch = max(prefill, n_seq)
    params.n_seq_max = n_seq
    params.kv_unified = True  # one KV buffer for all the sequences (its n_ctx shared, not split)
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, params)
    if not ctx:
        raise SystemExit("llama.cpp could not make a context of these sizes")
    b = L.llama_batch_init(max(prefill, n_seq), 0, 1)

    def fill(items) -> list[int]:
        """items: (token, pos, seq, wants logits); returns the batch rows whose logits come back."""
        b.n_tokens = len(items)
        rows = []
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
            if out:
                rows.append(i)
        return rows

    def decode(items) -> list[int]:
        rows = fill(items)
        if L.llama_decode(ctx, b) != 0:
            raise SystemExit("llama_decode failed")
        return [int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))
                for i in rows]

    t0 = time.perf_counter()
    nxt = decode([(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)])
    out = [[t] for t in nxt]
    for step in range(1, gen):
        nxt = decode([(nxt[s], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
        for s, t in enumerate(nxt):
            out[s].append(t)
    wall = time.perf_counter() - t0
    L.llama_batch_free(b)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return {"tokens": sum(map(len, out)), "wall": wall, "api": f"llama_batch, {n_seq} sequence ids", "token_ids": out}


def main() -> int:
    req = json.load(sys.stdin)
    out = {"probe": probe, "solo": solo, "prompt": prompt, "batch": batch}[req["op"]](req)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
