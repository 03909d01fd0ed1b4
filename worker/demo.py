"""``mlxq demo``: one command that shows the whole product working.

Starts an embedded Valkey server (unless a Redis URL is given), builds the
small local model and runs a worker with room for only 3 sequences, so jobs
wait and get preempted.  Every job shares one system prompt, so after the
first prefill the prefix cache serves it.  Low and normal jobs go in first;
once they stream, high-tier jobs arrive and take their place (preemption; the
preempted jobs resume later exactly where they stopped).  The streams are
shown side by side, paced (``PACE_S`` per engine step) so a person can follow
them, then per-job stats and the engine's block / prefix-hit /
preemption counters.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

SYSTEM_PROMPT = ("You are a storyteller on a long sea voyage. Every answer is a short story told to the "
                 "crew at night, with a ship, a harbour and the weather in it. ")
# (tier, prompt); the high-tier jobs arrive after the others stream
DEMO_PROMPTS = [
    ("low", "The old library by the river"),
    ("low", "Once upon a time, a small robot"),
    ("normal", "The weather in the mountains"),
    ("high", "The ship sailed across the sea"),
    ("normal", "A recipe for bread starts with"),
    ("high", "In the garden, the children"),
    ("normal", "The city at night is"),
    ("low", "Le petit café près de la gare"),
]
ROOM = 3  # sequences the demo worker runs at once: fewer than the jobs
PACE_S = 0.06  # seconds per engine step: about 16 tokens a second per stream


class _Paced:
    """The engine, one step per ``pace`` seconds: tokens at a pace a person can read."""

    def __init__(self, engine, pace: float):
        self._engine, self._pace, self._last = engine, pace, 0.0

    def step(self):
        wait = self._last + self._pace - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self._last = time.monotonic()
        return self._engine.step()

    def __getattr__(self, name):
        return getattr(self._engine, name)

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
    picked = DEMO_PROMPTS[: max(ROOM + 1, args.jobs)]
    early = [(t, p) for t, p in picked if t != "high"]
    late = [(t, p) for t, p in picked if t == "high"]
    print(f"{len(picked)} jobs for a worker with room for {ROOM}; all share one system prompt "
          f"({len(SYSTEM_PROMPT)} characters).\nSubmitting {len(early)} low/normal jobs now; "
          f"{len(late)} high-tier jobs arrive once they stream.")
    jobs = []

    def submit(tier, prompt):
        c = Client(url, api_key=KEYS[tier], model=model, settings=settings)
        job = c.submit(SYSTEM_PROMPT + prompt, max_tokens=args.max_tokens, temperature=0.6, top_p=0.9,
                       seed=len(jobs))
        jobs.append((tier, prompt, job))

    for tier, prompt in early:
        submit(tier, prompt)

    # The worker: its own thread, and every MLX call (loading included) on it.
    holder: dict = {}
    ready = threading.Event()

    def run_worker():
        from .model import load_model
        from .runner import Worker, make_engine

        try:
            loaded = load_model(model_src, name=model)
            # a small pool (64 blocks of 32 tokens) so the block counts are readable
            engine = _Paced(make_engine(loaded, max_batch=ROOM, num_blocks=64), getattr(args, "pace", PACE_S))
            holder["worker"] = Worker(client.redis.__class__.from_url(url), loaded, settings, engine=engine)
        finally:
            ready.set()
        holder["worker"].run()

    thread = threading.Thread(target=run_worker, name="mlxq-worker", daemon=True)
    thread.start()
    ready.wait()
    if "worker" not in holder:
        print("the worker failed to start", file=sys.stderr)
        return 1
    print(f"worker serving {model!r} with room for {ROOM} sequences at once\n")
    texts: dict = {}
    done = {}
    followers = []

    def follow(job):
        for delta in job.stream(timeout=300):
            texts[job.id] += delta.text
        done[job.id] = job.result(timeout=60)

    def start_following(from_index):
        for _, _, j in jobs[from_index:]:
            texts[j.id] = ""
            f = threading.Thread(target=follow, args=(j,), daemon=True)
            f.start()
            followers.append(f)

    start_following(0)
    tty = sys.stdout.isatty()
    width = 70
    while late:
        if sum(1 for t in texts.values() if t) >= ROOM:  # the worker is full and streaming
            n = len(jobs)
            for tier, prompt in late:
                submit(tier, prompt)
            late = []
            start_following(n)
        time.sleep(0.02)
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
    print("\n(rows in the order the worker started them; a preempted job shows its first start)\n")
    st = holder["worker"].engine.stats()
    print(f"KV blocks: {st['blocks_total']} of 32 tokens; now {st['blocks_used']} used, {st['blocks_cached']} "
          f"cached (prefix cache), {st['blocks_free']} free")
    print(f"prefix cache: {st['prefix_hit_tokens']} of {st['prompt_tokens']} prompt tokens served from cached "
          f"blocks ({st['prefix_hit_tokens'] / max(1, st['prompt_tokens']):.0%})")
    print(f"preemptions: {st['preemptions']} (each preempted job was requeued and resumed where it stopped)\n")
    time.sleep(1.2)  # let the stats refresh once more
    print(stats_mod.render(stats_mod.collect(client.redis, settings.prefix)))
    holder["worker"].request_stop(grace_s=5)
    thread.join(timeout=15)
    if server:
        server.stop()
    return 0
