"""Connections and client CPU for N concurrent streamed jobs: the client of a given git revision
(default: the commit before one-subscriber-per-client) against this tree's, side by side.

The worker is a fake publisher (a separate process) that does what a worker does per step: one
call of the fenced deltas script (for every job an XADD to its event stream and a PUBLISH of the
msgpack delta), then the completion script; so the figures isolate the client.  Each client runs in its own process:
it submits N jobs (each subscribed before enqueue), signals the fake worker, and streams all N
concurrently (asyncio tasks on an AsyncClient, or threads on a sync Client).  Connections are
counted with CLIENT LIST at the peak (all N subscribed, before the first delta).

    python bench/streams.py --jobs 1000 --tokens 32 [--before 78b7ea6] [--api async|sync]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CLIENT = textwrap.dedent('''
    import asyncio, json, os, resource, sys, threading, time
    import redis
    api, url, n, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    probe = redis.Redis.from_url(url, client_name="bench-probe")

    def cpu():
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    def peak():
        rows = probe.client_list()
        mine = [r for r in rows if r.get("name") not in ("bench-probe", "fake-worker")]
        subs = [r for r in rows if r.get("name") not in ("bench-probe", "fake-worker")
                and (int(r.get("sub", 0)) > 0 or int(r.get("ssub", 0)) > 0)]
        return len(mine), len(subs)

    def finish(c0, t0, texts, conns):
        out = dict(connections=conns[0], pubsub_connections=conns[1], client_cpu_s=round(cpu() - c0, 2),
                   wall_s=round(time.monotonic() - t0, 2), jobs=len(texts),
                   complete=sum(len(t) == tokens for t in texts))
        print("RESULT " + json.dumps(out), flush=True)

    if api == "async":
        from mlxq import AsyncClient

        async def main():
            c = AsyncClient(url, model="bench")
            c0, t0 = cpu(), time.monotonic()
            jobs = [await c.submit(prompt="x", max_tokens=tokens) for _ in range(n)]
            conns = peak()
            probe.set("bench:go", "1")

            async def follow(j):
                return "".join([d.text async for d in j.stream(timeout=300)])
            texts = await asyncio.gather(*(follow(j) for j in jobs))
            finish(c0, t0, texts, conns)
        asyncio.run(main())
    else:
        from mlxq import Client
        threading.stack_size(256 * 1024)
        c = Client(url, model="bench")
        c0, t0 = cpu(), time.monotonic()
        jobs = [c.submit(prompt="x", max_tokens=tokens) for _ in range(n)]
        conns = peak()
        probe.set("bench:go", "1")
        texts = [None] * n
        def follow(i):
            texts[i] = "".join(d.text for d in jobs[i].stream(timeout=300))
        ts = [threading.Thread(target=follow, args=(i,)) for i in range(n)]
        for t in ts: t.start()
        for t in ts: t.join()
        finish(c0, t0, texts, conns)
''')

FAKE_WORKER = textwrap.dedent('''
    import sys, time
    import redis
    from mlxq.shared import codec
    from mlxq.shared.keys import ModelKeys
    from mlxq.shared.protocol import Queue
    from mlxq.shared.settings import Settings
    url, n, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    r = redis.Redis.from_url(url, client_name="fake-worker")
    k = ModelKeys("bench")
    q = Queue(r, k, Settings(result_ttl_s=600))
    while not r.get("bench:go"):
        time.sleep(0.01)
    pulled = []
    while len(pulled) < n:
        pulled += [p for p in q.pull(n - len(pulled), "fake") if p.kind == "job"]
    for seq in range(1, tokens + 1):  # one round trip per engine step, as the Publisher does
        pipe = r.pipeline(transaction=False)
        last = seq == tokens

        def delta(p, finish=None):
            return codec.pack({"a": p.attempt, "s": seq, "n": seq - 1, "c": seq - 1, "t": "x", "i": [7],
                               "f": finish})
        if not last:  # the worker's fenced append + publish: one script call for the step
            q.run(q.calls.deltas([(p.job_id, f"fake:{p.attempt}", delta(p), seq) for p in pulled]), pipe)
        else:
            for p in pulled:
                res = codec.pack({"id": p.job_id, "text": "x" * tokens, "token_ids": [7] * tokens,
                                  "finish_reason": "length"})
                q.complete(p.job_id, f"fake:{p.attempt}", "done", res, delta(p, "length"), client=pipe)
        pipe.execute()
''')


def _old_tree(rev: str, tmp: Path) -> Path:
    """A checkout of ``rev`` laid out as an importable ``mlxq`` package (first on sys.path)."""
    src = tmp / "src"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(src), rev], check=True,
                   capture_output=True)
    pkg = tmp / "path" / "mlxq"
    pkg.mkdir(parents=True)
    for name in ("producer", "worker", "shared"):
        (pkg / name).symlink_to(src / name)
    (pkg / "__init__.py").write_text((src / "mlxq" / "__init__.py").read_text())
    return tmp / "path"


def _run(api: str, url: str, n: int, tokens: int, path_first: str | None) -> dict:
    import redis

    r = redis.Redis.from_url(url)
    r.flushall()
    r.hset("mlxq:models", "bench", b"\x80")  # an (empty) registry entry: the model exists
    env = dict(os.environ)
    if path_first:
        env["PYTHONPATH"] = path_first + os.pathsep + env.get("PYTHONPATH", "")
    worker = subprocess.Popen([sys.executable, "-c", FAKE_WORKER, url, str(n), str(tokens)], cwd="/")
    try:
        out = subprocess.run([sys.executable, "-c", CLIENT, api, url, str(n), str(tokens)], env=env,
                             capture_output=True, text=True, timeout=600, cwd="/")
    finally:
        worker.wait(timeout=120)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-4000:])
    return json.loads(line[0][len("RESULT "):])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--before", default="78b7ea6", help="the git revision whose client is 'before'")
    p.add_argument("--api", choices=("async", "sync"), default="async")
    args = p.parse_args(argv)
    from mlxq.shared.embedded import EmbeddedRedis

    with tempfile.TemporaryDirectory(prefix="mlxq-bench-streams-") as tmp:
        old_path = _old_tree(args.before, Path(tmp))
        server = EmbeddedRedis(maxclients=20000).start()
        try:
            rows = {"before": _run(args.api, server.url, args.jobs, args.tokens, str(old_path)),
                    "after": _run(args.api, server.url, args.jobs, args.tokens, None)}
        finally:
            server.stop()
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / "src")],
                           capture_output=True)
    b, a = rows["before"], rows["after"]
    print(f"{args.jobs} concurrent streamed jobs x {args.tokens} tokens, {args.api} client, one Redis")
    for name, row in rows.items():
        print(f"  {name:6s} ({args.before if name == 'before' else 'this tree'}): {json.dumps(row)}")
    print(f"  ratio before/after: connections {b['connections'] / max(1, a['connections']):.0f}x, "
          f"client CPU {b['client_cpu_s'] / max(0.01, a['client_cpu_s']):.2f}x, wall {b['wall_s'] / a['wall_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
