"""The gateway rides out a Cluster failover as the clients do, tried as a new user would:
a Valkey Cluster of 3 masters + 3 replicas (``cluster-node-timeout 2000``), one worker process
(``--max-batch 8``) and a separate ``mlxq gateway`` process, all given the same master's URL,
streamed completions from the official ``openai`` client.  The master serving the model's slot gets
``kill -9``, when it is the gateway's URL node (right after the submits, and near the end) and when
it is another master (mid-stream, and near the end).  Every stream's text equals the same request's answer
without a failover (computed in this run), no request gets a 500, the gateway logs no ASGI
exception, and a new request is served once the cluster is ok.

The worker is frozen (SIGSTOP) at each moment, so the kill surely finds the streams there; the
killed master is started again and made master once more (``CLUSTER FAILOVER``) for the next round.
``MLXQ_FAILOVER_LOOPS=N`` runs each victim's moments N times (default once), and
``MLXQ_FAILOVER_ALL_MOMENTS=1`` all three moments for both victims (a round is about 10 s: the suite
runs the two victims at two moments each, three moments in all)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from clusterkit import EmbeddedCluster
from mlxq.shared.connection import connect
from mlxq.shared.keys import ModelKeys
from workerkit import neutral_cwd, wait_for
from faultkit import (_LIVE, WorkerProc, detok_text, record, reference_tokens, start_again, wait_registered,
                      worker_env)

K = ModelKeys("tiny")
QUEUE_KEY = K.queue
N_STREAMS, MAX_TOKENS = 4, 300
LOOPS = int(os.environ.get("MLXQ_FAILOVER_LOOPS", "1"))
# when the worker is frozen and the master killed: once every request is submitted, once every
# stream has this many chunks (about one token each), and near the end
MOMENTS = {"after_submit": None, "mid_stream": 60, "near_the_end": MAX_TOKENS - 40}
ALL_MOMENTS = os.environ.get("MLXQ_FAILOVER_ALL_MOMENTS", "") not in ("", "0")
VICTIM_MOMENTS = {"the_url_node": ("after_submit", "near_the_end"), "another_master": ("mid_stream", "near_the_end")}


def _prompts():
    return [[4 + 7 * i, 20 + 3 * i, 7, 99 - i] for i in range(N_STREAMS)]


class GatewayProc:
    """``mlxq gateway`` in a process of its own, its log in a file."""

    def __init__(self, url: str, log_dir: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path = Path(log_dir) / f"gateway-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxq", "--log-level", "INFO", "gateway", "--redis-url", url,
             "--port", str(self.port)], cwd=neutral_cwd(), env=worker_env(), stdout=self._log,
            stderr=subprocess.STDOUT)
        _LIVE.append(self.proc)
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


class Round:
    """One kill: the streams' text and chunk counts, their errors, when chunks came."""

    def __init__(self):
        self.texts = [""] * N_STREAMS
        self.chunks = [0] * N_STREAMS
        self.errors: list = []
        self.killed_at = None
        self.after_kill: list[float] = []
        self.ended_at: list[float] = []
        self.lock = threading.Lock()

    def chunk(self, i: int, text: str) -> None:
        with self.lock:
            self.texts[i] += text
            self.chunks[i] += 1
            if self.killed_at is not None:
                self.after_kill.append(time.monotonic())

    def timings(self) -> dict:
        """kill -> the first chunk after the longest pause that followed the kill (chunks already on
        their way at the kill do not count as resumed), and kill -> the last stream's end."""
        times = [self.killed_at] + sorted(self.after_kill)
        gaps = [(b - a, b) for a, b in zip(times, times[1:])]
        resumed = max(gaps)[1] if gaps else None
        return dict(first_resumed_s=None if resumed is None else round(resumed - self.killed_at, 2),
                    last_result_s=round(max(self.ended_at) - self.killed_at, 2))


def _stream_all(oai, prompts, rnd: Round) -> list[threading.Thread]:
    def one(i, p):
        try:
            for c in oai.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, stream=True,
                                            extra_body={"ignore_eos": True}):
                if c.choices:
                    rnd.chunk(i, c.choices[0].text)
        except Exception as exc:  # reported by the test
            rnd.errors.append((i, repr(exc), traceback.format_exc()[-1200:]))
        finally:
            rnd.ended_at.append(time.monotonic())

    threads = [threading.Thread(target=one, args=(i, p), daemon=True) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("victim_is", ["the_url_node", "another_master"])
def test_gateway_rides_out_the_models_master_killed(victim_is, tiny_model, tiny_model_dir, tmp_path):
    import openai

    prompts = _prompts()
    refs = [detok_text(tiny_model.tokenizer, reference_tokens(tiny_model, p, MAX_TOKENS, ignore_eos=True))
            for p in prompts]
    with EmbeddedCluster(masters=3, replicas=1, node_timeout_ms=2000) as cluster:
        victim = cluster.master_for(QUEUE_KEY)
        given = victim if victim_is == "the_url_node" else next(m for m in cluster.masters if m is not victim)
        # speculation off: the moments count stream entries as about one token each
        worker = WorkerProc(given.url, tiny_model_dir, tmp_path, max_batch=8, speculate="off")
        r = connect(given.url)
        gw = GatewayProc(given.url, tmp_path)
        figures = []
        try:
            assert wait_registered(given.url, timeout=120), worker.log()
            oai = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
            assert wait_for(lambda: _answers(oai), timeout=60), gw.log()
            moments = MOMENTS if ALL_MOMENTS else {m: MOMENTS[m] for m in VICTIM_MOMENTS[victim_is]}
            rounds = [m for _ in range(LOOPS) for m in moments.items()]
            for n, (moment, chunks) in enumerate(rounds):
                rnd = Round()
                submitted = len(_submitted(gw.log()))
                threads = _stream_all(oai, prompts, rnd)
                ids = lambda: _submitted(gw.log())[submitted:]  # noqa: E731 - this round's jobs
                if chunks is None:
                    at = lambda: len(ids()) >= N_STREAMS  # noqa: E731
                else:  # what the worker has published (the streams read it a moment later)
                    at = lambda: len(ids()) >= N_STREAMS and min(r.xlen(K.events(j)) for j in ids()) >= chunks  # noqa: E731
                assert worker.run_until(at, timeout=120), (moment, rnd.chunks, gw.log()[-3000:])
                victim.kill()
                rnd.killed_at = time.monotonic()
                worker.thaw()
                for t in threads:
                    t.join(timeout=120)
                assert not any(t.is_alive() for t in threads), moment
                assert rnd.errors == [], (moment, rnd.errors)  # no 500, no error event
                assert rnd.texts == refs, moment  # every stream exact
                after = oai.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4,
                                               extra_body={"ignore_eos": True})
                assert after.choices[0].finish_reason == "length"
                figures.append((moment, rnd.timings()))
                if n + 1 < len(rounds):  # the same node serves the slot again for the next round
                    start_again(victim)
                    cluster.make_master_again(victim, QUEUE_KEY)
            log = gw.log()
            assert "Exception in ASGI application" not in log and "Traceback" not in log, log[-5000:]
            assert " 500 " not in log, log[-5000:]
            record(f"gateway process, cluster master killed ({victim_is}), {N_STREAMS} x {MAX_TOKENS}-token streams",
                   N_STREAMS * len(figures), N_STREAMS * len(figures), 0, 0,
                   **{m: f"{t['first_resumed_s']}s to the first resumed chunk, {t['last_result_s']}s to the last end"
                      for m, t in figures})
        finally:
            r.close()
            gw.stop()
            worker.stop()


def _submitted(log: str) -> list[str]:
    """The ids of the jobs the gateway submitted, in order (its log lines)."""
    return [line.split("job=", 1)[1].split()[0] for line in log.splitlines() if "submitted by" in line]


def _answers(oai) -> bool:
    try:
        return bool(oai.models.list().data)
    except Exception:  # not up yet
        return False
