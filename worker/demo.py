"""``mlxq demo``: one command that shows the whole product working.

Starts an embedded Valkey server (unless a Redis URL is given), builds the
small local model, runs a worker, submits a mix of high/normal/low jobs,
streams them side by side and prints per-job and aggregate stats.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

DEMO_PROMPTS = [
    ("low", "The old library by the river"),
    ("low", "Once upon a time, a small robot"),
    ("normal", "The weather in the mountains"),
    ("normal", "A recipe for bread starts with"),
    ("high", "The ship sailed across the sea"),
    ("high", "In the garden, the children"),
    ("normal", "The city at night is"),
    ("low", "Le petit café près de la gare"),
]

KEYS = {"high": "demo-key-high-tier", "normal": None, "low": "demo-key-batch-tier"}


def _cache_dir() -> Path:
    return Path(os.environ.get("MLXQ_CACHE_DIR", Path.home() / ".cache" / "mlxq"))


def main(args) -> int:
    from mlxq.producer import Client
    from mlxq.producer import stats as stats_mod
    from mlxq.shared import apikeys
    from mlxq.shared.embedded import EmbeddedRedis
    from mlxq.shared.keys import GlobalKeys
    from mlxq.shared.settings import Settings

    from . import BLAS_STATUS

    logging.getLogger("mlxq.worker").setLevel(logging.WARNING)
    server = None
    url = args.redis_url
    if not url:
        server = EmbeddedRedis().start()
        url = server.url
        print(f"embedded Valkey server at {url}")
    print(f"BLAS: {BLAS_STATUS}")
    model_src = args.model
    if not model_src:
        from .make_model import ensure_model

        t0 = time.perf_counter()
        model_src = str(ensure_model(_cache_dir() / "tiny-model", "tiny"))
        print(f"small local model ready in {model_src} ({time.perf_counter() - t0:.1f}s)")

    settings = Settings.from_env(redis_url=url, gather_ms=20.0)
    client = Client(url, settings=settings)
    for tier, key in KEYS.items():
        if key:
            apikeys.add_key(client.redis, GlobalKeys(settings.prefix).api_keys, key, tier)

    from mlxq.shared.keys import model_name

    model = model_name(model_src)
    print(f"submitting {args.jobs} jobs (low tier first, high last) before the worker starts, "
          f"so it has to choose")
    jobs = []
    for tier, prompt in DEMO_PROMPTS[: args.jobs]:
        c = Client(url, api_key=KEYS[tier], model=model, settings=settings)
        jobs.append((tier, prompt, c.submit(prompt, max_tokens=args.max_tokens, temperature=0.6, top_p=0.9,
                                            seed=len(jobs))))

    # The worker: its own thread, and every MLX call (loading included) on it.
    holder: dict = {}
    ready = threading.Event()

    def run_worker():
        from .model import load_model
        from .runner import Worker

        try:
            loaded = load_model(model_src, name=model)
            holder["worker"] = Worker(client.redis.__class__.from_url(url), loaded, settings, max_batch=4)
        finally:
            ready.set()
        holder["worker"].run()

    thread = threading.Thread(target=run_worker, name="mlxq-worker", daemon=True)
    thread.start()
    ready.wait()
    if "worker" not in holder:
        print("the worker failed to start", file=sys.stderr)
        return 1
    print(f"worker serving {model!r} with room for 4 sequences at once\n")
    texts = {j.id: "" for _, _, j in jobs}
    done = {}

    def follow(job):
        for delta in job.stream(timeout=300):
            texts[job.id] = delta.text if delta.restart else texts[job.id] + delta.text
        done[job.id] = job.result(timeout=60)

    followers = [threading.Thread(target=follow, args=(j,), daemon=True) for _, _, j in jobs]
    for f in followers:
        f.start()
    tty = sys.stdout.isatty()
    width = 70
    while len(done) < len(jobs):
        if tty:
            lines = []
            for tier, prompt, j in jobs:
                state = "done" if j.id in done else ("streaming" if texts[j.id] else "queued")
                text = (prompt + texts[j.id]).replace("\n", " ")[-width:]
                lines.append(f"{tier:>6} {state:>9} | {text}")
            sys.stdout.write("\x1b[2K" + "\n\x1b[2K".join(lines) + f"\x1b[{len(lines) - 1}F\r")
            sys.stdout.flush()
        time.sleep(0.1)
    for f in followers:
        f.join()
    if tty:
        sys.stdout.write("\n" * len(jobs))
    print(f"{'tier':>6} {'wait s':>7} {'ttft s':>7} {'tokens':>6} {'tok/s':>6} {'finish':>7}  text")
    rank = {"high": 0, "normal": 1, "low": 2}  # jobs pulled together start at the same instant
    order = sorted(jobs, key=lambda x: (round(done[x[2].id].stats.started_at or 0, 2), rank[x[0]]))
    for tier, prompt, j in order:
        r = done[j.id]
        s = r.stats
        print(f"{tier:>6} {s.queue_wait_s or 0:7.2f} {s.ttft_s or 0:7.2f} {s.generated_tokens:6d} "
              f"{s.generation_tps or 0:6.1f} {r.finish_reason:>7}  {(prompt + r.text).replace(chr(10), ' ')[:90]}")
    print("\n(rows in the order the worker started them: high and normal jobs go ahead of older low-tier ones)\n")
    time.sleep(1.2)  # let the stats refresh once more
    print(stats_mod.render(stats_mod.collect(client.redis, settings.prefix)))
    holder["worker"].request_stop(grace_s=5)
    thread.join(timeout=15)
    if server:
        server.stop()
    return 0
