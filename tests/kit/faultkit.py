"""Helpers for the fault, fuzz, scale-out and security tests: worker subprocesses (so that
kill -9 and SIGTERM hit a real process), reference tokens, stream collection and figures."""

from __future__ import annotations

import atexit
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import redis
from workerkit import neutral_cwd

from mlxq.shared.keys import ModelKeys

FROZEN_WORKER = Path(__file__).with_name("frozen_worker.py")  # `mlxq` whose engine hangs at a step, or always speculates

FIGURES: list[dict] = []  # one row per fault test, printed at the end of each test


def worker_env(**settings) -> dict:
    env = dict(os.environ)
    # takeover_s: a live worker on a loaded machine is not judged dead at 2.5 beats of 0.5 s (a test that
    # measures the takeover sets its own)
    base = dict(gather_ms=2, idle_block_s=0.2, stats_interval_s=0.2, heartbeat_s=0.5, lease_s=5)
    base.update(settings)
    base.setdefault("takeover_s", max(3.0, 2.5 * float(base["heartbeat_s"])))
    for k, v in base.items():
        env[k if k.startswith("MLXQ_") else f"MLXQ_{k.upper()}"] = str(v)
    return env


_LIVE: list[subprocess.Popen] = []


@atexit.register
def _kill_leftovers() -> None:
    for p in _LIVE:
        if p.poll() is None:
            p.kill()


class WorkerProc:
    """``mlxq worker`` as a subprocess (logs to a file, shown when a test fails)."""

    def __init__(self, url: str, model_dir, log_dir: Path, *, name: str = "tiny", max_batch: int = 16,
                 grace: float = 30.0, extra: Optional[list[str]] = None, freeze_at_step: Optional[int] = None,
                 speculate_always: bool = False, **settings):
        """``freeze_at_step``: the engine's step of that number never returns; ``speculate_always``: every
        step where a row has a proposal verifies it (kit/frozen_worker.py)."""
        self.log_path = Path(log_dir) / f"worker-{time.monotonic_ns()}.log"
        mode = "speculate" if speculate_always else freeze_at_step
        mlxq = ["-m", "mlxq"] if mode is None else [str(FROZEN_WORKER), str(mode)]
        cmd = [sys.executable, *mlxq, "--log-level", "INFO", "worker", "--redis-url", url,
               "--model", str(model_dir), "--queue", name, "--max-batch", str(max_batch), "--grace", str(grace)]
        cmd += extra or []
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=neutral_cwd(), env=worker_env(**settings), stdout=self._log,
                                     stderr=subprocess.STDOUT)
        _LIVE.append(self.proc)  # never left behind: an orphan would reconnect to a reused port

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def term(self) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def freeze(self) -> None:
        """SIGSTOP: the worker makes no more progress until ``thaw`` (or a kill), so a test can read
        the jobs' states at an exact point instead of racing the worker."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def run_until(self, pred, timeout: float = 240.0, slice_s: float = 0.02) -> bool:
        """Let the worker run in short slices and check ``pred`` while it is frozen: it returns True
        with the worker frozen at a point where ``pred`` holds, having run at most about one slice
        past the first point where it did (the worker makes no progress while the test looks)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            time.sleep(slice_s)
            self.freeze()
            if pred():
                return True
            self.thaw()
        return False

    def wait_log(self, text: str, timeout: float = 60.0) -> bool:
        """Wait until the worker's log shows ``text`` (an event the worker itself produces)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if text in self.log():
                return True
            if self.proc.poll() is not None:
                return text in self.log()
            time.sleep(0.01)
        return False

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # this test's own child, by pid
            self.proc.wait(timeout=10)
        self._log.close()


def start_again(node) -> None:
    """Start a killed server (an ``EmbeddedRedis``) again on its port and data directory."""
    node._server._desired_port = node.port
    end = time.monotonic() + 30
    while True:
        try:
            node.start()
            return
        except OSError:  # the killed process still holds the port for a moment
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


def wait_registered(url: str, model: str = "tiny", n: int = 1, timeout: float = 60.0) -> bool:
    """Wait until ``n`` workers of ``model`` have published stats (they are serving)."""
    from mlxq.shared.connection import connect
    from mlxq.shared.keys import ModelKeys

    r = connect(url)

    k = ModelKeys(model)
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            if r.zcard(k.workers) >= n:
                return True
            time.sleep(0.05)
        return False
    finally:
        r.close()


def reference_tokens(loaded, prompt_ids, max_tokens, ignore_eos=False, sampling: Optional[dict] = None,
                     speculate: Optional[str] = None):
    """The worker's greedy answer for this one sequence (cut at the first EOS unless ``ignore_eos``),
    computed in this process by the worker's own engine (``make_engine`` with this environment's
    settings, as a worker process here builds it) with this sequence alone in it.

    A worker streams exactly these tokens whatever else shares its batches, and whatever crash,
    requeue or preemption the job goes through: every op of the engine gives a row the same bits
    in any batch and at any join (tests/engine/test_linear_op.py, tests/engine/test_engine.py), and a
    resumed job re-reads its context exactly. The engine's agreement with mlx-lm's own decoding is
    tested separately (tests/engine/test_engine.py, tests/worker/test_e2e.py), at horizons where two
    correct summation orders cannot part at a near-tie; a fault test's 480-token streams can (MLX's
    matmul gives a row other bits in a batch of 2 to 4 rows, depending on the BLAS), so they compare
    with this.  ``sampling``: a seeded job's SamplingParams fields (its seed among them), for its
    tokens instead; ``speculate``: that setting instead of this environment's."""
    from mlxq.shared.schemas import SamplingParams
    from mlxq.shared.settings import Settings
    from mlxq.worker.engine.engine import make_engine
    from mlxq.worker.engine.api import SeqSpec
    from mlxq.worker.engine.sampler import make_sampler

    blocks = (len(prompt_ids) + max_tokens) // 32 + 4
    settings = Settings.from_env(kv_blocks=blocks, kv_memory_mb=None, session_dir=None, speculate=speculate)
    key = (id(loaded), tuple(prompt_ids), max_tokens, ignore_eos, settings.attention, settings.matmul,
           settings.kv_bits, settings.kv_group_size, settings.speculate, tuple(sorted((sampling or {}).items())))
    if key not in _references:
        engine = make_engine(loaded, settings)
        sampler = make_sampler(SamplingParams(**sampling), sampling["seed"]) if sampling else None
        engine.add([SeqSpec("ref", list(prompt_ids), max_tokens, sampler=sampler,
                            stop_token_ids=() if ignore_eos else None)])
        out = []
        while engine.has_work():
            out += [e.token for e in engine.step()[0] if e.error is None]
        if not ignore_eos and out and out[-1] in loaded.eos_token_ids:
            out.pop()  # the job's tokens: the EOS that ends it is not one of them
        _references[key] = out
    return list(_references[key])


_references: dict = {}


def detok_text(tokenizer, ids):
    """A job's text for these tokens: exactly ``decode(ids)``, as OpenAI and vLLM return it."""
    return tokenizer.decode(ids)


class StreamCollector(threading.Thread):
    """Follows ``job.stream()`` on a thread: the text and token ids it shows, each once."""

    def __init__(self, job, timeout: float = 120.0):
        super().__init__(daemon=True)
        # its own handle: a Job is not shared between threads (result() closes its pub/sub)
        self.job, self.timeout = job._client.job(job.id, job._keys.model), timeout
        self.text, self.ids, self.finishes, self.error = "", [], [], None

    def run(self) -> None:
        try:
            for d in self.job.stream(timeout=self.timeout):
                self.text += d.text
                self.ids += d.token_ids
                if d.finish_reason:
                    self.finishes.append(d.finish_reason)
        except Exception as exc:  # reported by the test
            self.error = exc


def submit_and_follow(client, specs) -> tuple[list, list["StreamCollector"]]:
    """Submit ``(prompt_tokens, max_tokens, ignore_eos)`` specs and follow each job's stream on a
    thread (started); returns (jobs, collectors)."""
    jobs = [client.submit(prompt_tokens=p, max_tokens=n, ignore_eos=ie) for p, n, ie in specs]
    collectors = [StreamCollector(j) for j in jobs]
    for c in collectors:
        c.start()
    return jobs, collectors


def record(name: str, submitted: int, completed: int, lost: int, duplicated: int, **extra) -> dict:
    row = dict(test=name, submitted=submitted, completed=completed, lost=lost, duplicated=duplicated, **extra)
    FIGURES.append(row)
    print(f"\nFIGURES {name}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k != "test"), flush=True)
    return row


def executions_by_job(r, keys, job_ids) -> dict[str, int]:
    """How many attempts each job's event stream shows (distinct ``attempt`` values of its deltas)."""
    from mlxq.shared.replay import read_payloads

    return {jid: len({d.get("a") for payload in read_payloads(r, keys, jid) for d in payload if "a" in d})
            for jid in job_ids}


class StepGate:
    """Holds a worker's MLX thread between two engine steps, so that what a test does meanwhile (a
    Redis restart) surely finds the jobs mid-run, however fast this machine or these weights generate.

    It counts each job's tokens from the steps' events; once every job given to :meth:`hold_when`
    has ``n`` tokens or has finished, the step waits (its events not yet handed to the worker) until
    the gate is released.  Use it as a context manager inside ``running_worker``: leaving it releases
    the gate and puts the engine's own ``step`` back."""

    def __init__(self, engine):
        self.engine, self._engine_step = engine, engine.step
        self.tokens: Counter = Counter()
        self.finished: set = set()
        self.held, self._go = threading.Event(), threading.Event()
        self._watch: Optional[tuple[set, int]] = None
        engine.step = self._step

    def hold_when(self, uids, n: int) -> None:
        self._watch = (set(uids), n)

    def release(self) -> None:
        self._go.set()

    def _step(self):
        events, preempted = self._engine_step()
        for e in events:
            self.tokens[e.uid] += 1
            if e.finish_reason:
                self.finished.add(e.uid)
        watch = self._watch
        if watch and not self._go.is_set() and all(
                self.tokens[u] >= watch[1] or u in self.finished for u in watch[0]):
            self.held.set()
            self._go.wait()
        return events, preempted

    def __enter__(self) -> "StepGate":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        del self.engine.step


# -- the jobs of the fault tests and their check against the solo references ------------------------

def _specs(seed, n, max_tokens, ignore_eos_every=2):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(4, 900) for _ in range(rng.randrange(3, 24))]
        out.append((prompt, max_tokens, i % ignore_eos_every == 0))
    return out


def _xlen(r, job_id):
    return r.xlen(ModelKeys("tiny").events(job_id))


def _check_results(loaded, results, refs, collectors=None):
    """(completed correctly, lost, duplicated) against the solo references."""
    ok = lost = dup = 0
    for i, (res, ref) in enumerate(zip(results, refs)):
        if res is None or res.finish_reason not in ("stop", "length"):
            lost += 1
            continue
        if len(res.token_ids) > len(ref) or res.token_ids != ref:
            dup += 1
            continue
        assert res.text == detok_text(loaded.tokenizer, ref), i
        if collectors is not None:
            c = collectors[i]
            assert c.error is None, (i, c.error)
            assert c.text == res.text, i  # what the client streamed across the fault == the result
            assert c.ids == res.token_ids, i  # each token index once, whatever the attempt
            assert c.finishes == [res.finish_reason], i
        ok += 1
    return ok, lost, dup
