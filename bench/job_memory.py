"""Bytes of Redis a finished job keeps, before and after its event stream is compacted into its
record (complete.lua + _compact.lua), side by side in one run.

The real worker runs each job (greedy, ``ignore_eos``, so every job has exactly its token count) on
an embedded Valkey, twice: once as a finished job was kept before its record was slimmed (CHANGELOG, 2026-12) (the bench swaps
``_compact.lua`` for a stub that keeps every stream, completion keeps the fields it now drops, the
result keeps its id and a list of token ids, the request every default), once as it is now.  The
figures are ``MEMORY USAGE <key> SAMPLES 0`` summed over the finished job's keys (job hash, event
stream, done list).  The budget is 2 KiB beyond the job's output text: its token ids count (as the
record keeps them: a string, one character an id); logprobs (none here) excluded.

    python bench/job_memory.py [--tokens 8 300] [--model tiny|smollm2|both]
"""

from __future__ import annotations

import argparse
import datetime
import sys

from mlxq.worker import blas

blas.setup()

import threading  # noqa: E402

import redis  # noqa: E402

from mlxq import Client  # noqa: E402
from mlxq.producer import core  # noqa: E402
from mlxq.shared import codec, protocol, replay  # noqa: E402
from mlxq.shared.schemas import Result  # noqa: E402
from mlxq.shared.embedded import EmbeddedRedis  # noqa: E402
from mlxq.shared.keys import GlobalKeys, ModelKeys  # noqa: E402
from mlxq.shared.settings import Settings, cache_dir  # noqa: E402
from mlxq.worker.model import load_model  # noqa: E402
from mlxq.worker.runner import Worker  # noqa: E402

BUDGET = 2048
PROMPT = "Write a long story about a lighthouse keeper."


def model_source(which: str) -> str:
    if which == "smollm2":
        from mlxq.devkit.smollm2 import INSTALL, smollm2_gguf

        path = smollm2_gguf()
        if path is None:
            sys.exit(f"SmolLM2 is not installed: {INSTALL}")
        return str(path)
    from mlxq.devkit.make_model import ensure_model, seed_from_env, seeded_dir

    return str(ensure_model(seeded_dir(cache_dir(), "tiny", seed_from_env()), "tiny", seed=seed_from_env()))


def usage(r, keys) -> int:
    return sum(r.memory_usage(k, samples=0) or 0 for k in keys)


def as_before(before: bool) -> None:
    """A finished job kept as it was before its record was slimmed (CHANGELOG, 2026-12) (``before``), or as it is now."""
    if not hasattr(protocol, "_lua_now"):
        protocol._lua_now = protocol._lua
        as_before.now = (Result.record, core.pack_request)

    def lua(name: str) -> str:
        text = protocol._lua_now(name)
        if not before:
            return text
        if name == "_compact":
            return "local function mlxq_compact() return nil end"
        if name == "complete":
            start = text.index("redis.call('HDEL', KEYS[1], 'owner'")
            end = text.index("\n", text.index(")", start))
            return text[:start] + "redis.call('HDEL', KEYS[1], 'owner', 'cancel', 'resume')" + text[end:]
        return text

    def old_request(req):
        default_max = set() if "max_tokens" in req.model_fields_set else {"max_tokens"}
        return codec.pack(req.model_dump(mode="json", exclude_none=True, exclude=default_max))

    protocol._lua = lua
    protocol.script_source.cache_clear()
    protocol.function_library.cache_clear()
    Result.record, core.pack_request = ((lambda self: codec.pack(self.model_dump())), old_request) if before \
        else as_before.now


def run(loaded, token_counts: list[int], url: str, compact: bool) -> list[dict]:
    """Each job's figures, served by a worker that keeps a finished job as now (``compact``) or as
    before its record was slimmed (CHANGELOG, 2026-12)."""
    as_before(not compact)
    r = redis.Redis.from_url(url)
    r.flushall()
    w = Worker(redis.Redis.from_url(url), loaded, Settings(redis_url=url, gather_ms=2.0, idle_block_s=0.2))
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    rows = []
    try:
        while not r.hexists(GlobalKeys().models, loaded.name):
            t.join(0.05)
        keys = ModelKeys(loaded.name)
        with Client(url, model=loaded.name) as c:
            for n in token_counts:
                res = c.submit(PROMPT, max_tokens=n, ignore_eos=True, temperature=0.0).result(timeout=600)
                ks = [keys.job(res.id), keys.events(res.id), keys.done(res.id)]
                assert compact != r.exists(keys.events(res.id)), "compacted iff the scripts compact"
                rows.append(dict(bytes=usage(r, ks), text=len(res.text.encode()), ids=len(codec.pack(codec.pack_ids(res.token_ids))),
                                 events=len(r.hget(keys.job(res.id), replay.FIELD) or b""), out=res.token_ids))
    finally:
        w.request_stop(grace_s=0)
        t.join(30)
        r.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 300])
    ap.add_argument("--model", choices=("tiny", "smollm2", "both"), default="both")
    args = ap.parse_args()
    server = EmbeddedRedis().start()
    try:
        rows = []
        for which in (("tiny", "smollm2") if args.model == "both" else (args.model,)):
            loaded = load_model(model_source(which), name=which)
            before = run(loaded, args.tokens, server.url, compact=False)
            after = run(loaded, args.tokens, server.url, compact=True)
            for n, b, a in zip(args.tokens, before, after):
                assert a["out"] == b["out"], "greedy: the same tokens on both sides"
                rows.append(dict(a, model=which, tokens=n, before=b["bytes"], after=a["bytes"]))
    finally:
        server.stop()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, python bench/job_memory.py "
          + " ".join(sys.argv[1:]))
    print("| model | tokens | before (B) | after (B) | text (B) | token ids, as kept (B) | events record (B) "
          "| after − text (B) | within 2 KiB + text | 10⁶ jobs before → after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        rest = x["after"] - x["text"]
        print(f"| {x['model']} | {x['tokens']} | {x['before']} | {x['after']} | {x['text']} | {x['ids']} "
              f"| {x['events']} | {rest} | {'yes' if rest <= BUDGET else 'NO'} "
              f"| {x['before'] / 1e3:.1f} → {x['after'] / 1e3:.1f} GB |")


if __name__ == "__main__":
    main()
