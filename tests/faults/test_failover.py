"""Producers ride out a Redis restart and a Cluster failover: the sync Client, the
AsyncClient and the gateway (official openai client) keep every stream token-exact when the
server they were given dies mid-run, and work again afterwards; a URL may name several seeds;
no wait has no end.

Every job ignores EOS and is long by construction, and the kill comes once several jobs have
streamed tokens, so jobs are surely under way at the kill.  Expected tokens are the same model's answers
to each job alone, computed in the same run (``reference_tokens``), never from hard-coded text.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import traceback

import pytest

from mlxq import AsyncClient, Client
from mlxq.shared.embedded import EmbeddedRedis
from clusterkit import EmbeddedCluster
from mlxq.shared.keys import ModelKeys
from workerkit import fast_settings, wait_for
from faultkit import WorkerProc, detok_text, record, reference_tokens, start_again, wait_registered

N_JOBS, MAX_TOKENS, STARTED, STARTED_TOKENS = 24, 48, 8, 5
QUEUE_KEY = ModelKeys("tiny").queue


def _prompts(n, salt=0):
    return [[4 + (i + salt) % 60, 20 + (3 * i + salt) % 70, 7, 99 - i % 30] for i in range(n)]


class Run:
    """Per job: the streamed token ids and text, the result; when the first delta after the kill
    and the last result came (monotonic)."""

    def __init__(self, n: int):
        self.tokens = [[] for _ in range(n)]
        self.texts = [""] * n
        self.results = [None] * n
        self.errors: list = []
        self.killed_at: float | None = None
        self.after_kill: list[float] = []  # when each delta came after the kill
        self.last_result: float | None = None
        self.done_at = [None] * n
        self.last_delta = [None] * n  # each job's last delta after the kill
        self._lock = threading.Lock()

    def delta(self, i: int, token_ids, text: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.tokens[i] += list(token_ids)
            self.texts[i] += text
            if self.killed_at is not None:
                self.after_kill.append(now)
                self.last_delta[i] = now

    def done(self, i: int, res) -> None:
        with self._lock:
            self.results[i] = res
            self.last_result = self.done_at[i] = time.monotonic()

    def started(self) -> int:
        with self._lock:
            return sum(len(t) >= STARTED_TOKENS or len(x) >= STARTED_TOKENS for t, x in zip(self.tokens, self.texts))

    def resumed_at(self):
        """The first delta after the longest pause following the kill (deltas already on their way
        at the kill come first and do not count as resumed)."""
        times = [self.killed_at] + sorted(self.after_kill)
        gaps = [(b - a, b) for a, b in zip(times, times[1:])]
        return max(gaps)[1] if gaps else None

    def timings(self) -> dict:
        def since_kill(t):
            return None if t is None else round(t - self.killed_at, 2)
        print("  results after the kill (s):", sorted(since_kill(t) for t in self.done_at if t is not None))
        print("  per job, last delta -> result after the kill (s):",
              sorted((since_kill(a), since_kill(b)) for a, b in zip(self.last_delta, self.done_at) if a and b))
        return dict(kill_to_first_resumed_delta_s=since_kill(self.resumed_at()),
                    kill_to_last_result_s=since_kill(self.last_result))


def _sync_jobs(url, prompts, run: Run, settings, max_tokens=MAX_TOKENS):
    client = Client(url, model="tiny", settings=settings)

    def one(i, job):
        try:
            for d in job.stream(timeout=300):
                run.delta(i, d.token_ids, d.text)
            run.done(i, job.result(timeout=300))
        except Exception as exc:
            run.errors.append((i, repr(exc), traceback.format_exc()[-1500:]))

    jobs = [client.submit(prompt_tokens=p, max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    threads = [threading.Thread(target=one, args=(i, j), daemon=True) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    return client, threads


def _async_jobs(url, prompts, run: Run, settings):
    """The AsyncClient's jobs on an event loop of their own thread."""
    holder = {}

    async def one(client, i, p):
        try:
            job = await client.submit(prompt_tokens=p, max_tokens=MAX_TOKENS, ignore_eos=True)
            async for d in job.stream(timeout=300):
                run.delta(i, d.token_ids, d.text)
            run.done(i, await job.result(timeout=300))
        except Exception as exc:
            run.errors.append((i, repr(exc), traceback.format_exc()[-1500:]))

    async def main():
        client = AsyncClient(url, model="tiny", settings=settings)
        await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))
        holder["after"] = await _async_new_job(client)
        await client.aclose()

    t = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    t.start()
    return holder, [t]


async def _async_new_job(client):
    job = await client.submit(prompt_tokens=[5, 6, 7], max_tokens=4, ignore_eos=True)
    return await job.result(timeout=120)


def _gateway_jobs(gw_url, prompts, run: Run, max_tokens=MAX_TOKENS):
    import openai

    oai = openai.OpenAI(base_url=f"{gw_url}/v1", api_key="EMPTY", max_retries=0, timeout=300)

    def one(i, p):
        try:
            for c in oai.completions.create(model="tiny", prompt=p, max_tokens=max_tokens, stream=True,
                                            extra_body={"ignore_eos": True}):
                if c.choices:
                    run.delta(i, [], c.choices[0].text)
            run.done(i, "streamed")
        except Exception as exc:
            run.errors.append((i, repr(exc), traceback.format_exc()[-1500:]))

    threads = [threading.Thread(target=one, args=(i, p), daemon=True) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    return oai, threads


def _check(run: Run, refs, tokenizer, *, tokens: bool = True) -> None:
    assert run.errors == []
    for i, ref in enumerate(refs):
        want = detok_text(tokenizer, ref)
        if tokens:
            assert run.results[i].token_ids == ref, i
        assert run.texts[i] == want, i  # streamed text == the uncrashed reference
        if tokens:
            res = run.results[i]
            assert run.tokens[i] == res.token_ids == ref, i  # each index once: stream == result == ref
            assert res.text == want, i


def _join(threads, timeout=300):
    end = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.1, end - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a client thread is still blocked"


# -- a single Redis restarted -------------------------------------------------------------------------
def test_single_redis_restart_mid_stream_client_and_gateway(tiny_model, tiny_model_dir, tmp_path):
    """Kill -9 the server (AOF always) while 12 Client jobs and 12 gateway streams run; restart it
    2 s later on the same port and data: every stream is exact, and both work afterwards."""
    from mlxq.producer.gateway import ServerThread, create_app

    # long by construction: the HTTP streams start first, so they are three times as long as the
    # Client's jobs; all of them are still under way when the last Client job has started
    n, long, long_g = 12, 160, 480
    prompts = _prompts(2 * n, salt=3)
    refs = [reference_tokens(tiny_model, p, long if i < n else long_g, ignore_eos=True)
            for i, p in enumerate(prompts)]
    srv = EmbeddedRedis(tmp_path / "data", persist=True).start()
    worker = WorkerProc(srv.url, tiny_model_dir, tmp_path, max_batch=24)
    try:
        settings = fast_settings(srv.url)
        assert wait_registered(srv.url), worker.log()
        with ServerThread(create_app(srv.url, settings)) as gw:
            run_c, run_g = Run(n), Run(n)
            # the HTTP streams first: once they all stream, the Client's jobs join the same batch
            oai, gthreads = _gateway_jobs(gw, prompts[n:], run_g, long_g)
            assert wait_for(lambda: run_g.started() == n, timeout=120), worker.log()
            client, threads = _sync_jobs(srv.url, prompts[:n], run_c, settings, long)
            assert wait_for(lambda: run_c.started() == n, timeout=120), worker.log()
            under_way = sum(r is None for r in run_c.results + run_g.results)
            assert under_way >= n  # the 12 HTTP streams at least (480 tokens each)
            srv.kill()
            run_c.killed_at = run_g.killed_at = time.monotonic()
            time.sleep(2)
            start_again(srv)
            _join(threads + gthreads)
            _check(run_c, refs[:n], tiny_model.tokenizer)
            _check(run_g, refs[n:], tiny_model.tokenizer, tokens=False)
            after = client.submit(prompt_tokens=[5, 6, 7], max_tokens=4, ignore_eos=True).result(timeout=60)
            assert after.finish_reason == "length"
            again = oai.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4,
                                           extra_body={"ignore_eos": True})
            assert again.choices[0].text == after.text
            record("single Redis kill -9 + restart 2 s later: 12 Client + 12 gateway streams", 2 * n, 2 * n, 0, 0,
                   client=run_c.timings(), gateway=run_g.timings())
            client.close()
    finally:
        worker.stop()
        srv.stop()


# -- a Cluster master killed ----------------------------------------------------------------------------
@pytest.fixture
def cluster():
    c = EmbeddedCluster(masters=3, replicas=1, node_timeout_ms=1000).start()
    yield c
    c.stop()


def _seed_url(nodes) -> str:
    return "redis://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes) + "/0"


@pytest.fixture(scope="module")
def url_master(tiny_model_dir, tmp_path_factory):
    """One cluster and one worker for the three kinds below: the worker is given only the URL of
    the master serving the model's slot.  Each test kills that master; it is started again and made
    the slot's master again before the next, so each kind meets the same fault (a fresh cluster
    for each cost 6-7 s more each)."""
    with EmbeddedCluster(masters=3, replicas=1, node_timeout_ms=1000) as c:
        victim = c.master_for(QUEUE_KEY)
        worker = WorkerProc(victim.url, tiny_model_dir, tmp_path_factory.mktemp("url-master"), max_batch=8)
        try:
            assert wait_registered(victim.url, timeout=120), worker.log()
            yield c, victim, worker
        finally:
            worker.stop()


@pytest.mark.parametrize("kind", ["client", "async", "gateway"])
def test_the_master_in_the_url_killed_mid_stream(kind, url_master, tiny_model):
    """The URL names only the master serving the model's slot; it gets kill -9 while 24 jobs
    stream.  Every stream == its result == the reference, and a new job works afterwards."""
    cluster, victim, worker = url_master
    url = victim.url
    prompts = _prompts(N_JOBS, salt={"client": 0, "async": 1, "gateway": 2}[kind])
    refs = [reference_tokens(tiny_model, p, MAX_TOKENS, ignore_eos=True) for p in prompts]
    gw_ctx, killed = None, False
    try:
        settings = fast_settings(url)
        run = Run(N_JOBS)
        if kind == "client":
            client, threads = _sync_jobs(url, prompts, run, settings)
        elif kind == "async":
            holder, threads = _async_jobs(url, prompts, run, settings)
        else:
            from mlxq.producer.gateway import ServerThread, create_app

            gw_ctx = ServerThread(create_app(url, settings))
            oai, threads = _gateway_jobs(gw_ctx.__enter__(), prompts, run)
        assert wait_for(lambda: run.started() >= STARTED, timeout=120), worker.log()
        victim.kill()
        killed, run.killed_at = True, time.monotonic()
        _join(threads)
        _check(run, refs, tiny_model.tokenizer, tokens=kind != "gateway")
        live = [n for n in cluster.nodes if n is not victim]
        cluster.wait_ok(60, nodes=live)
        assert cluster.master_for(QUEUE_KEY) is not victim
        if kind == "client":
            after = client.submit(prompt_tokens=[5, 6, 7], max_tokens=4, ignore_eos=True).result(timeout=120)
            client.close()
        elif kind == "async":
            after = holder["after"]
        else:
            c = oai.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, extra_body={"ignore_eos": True})
            after = c.choices[0]
        assert after.finish_reason == "length"
        record(f"cluster: master in the URL killed, 24 streams ({kind})", N_JOBS, N_JOBS, 0, 0, **run.timings())
    finally:
        if gw_ctx is not None:
            gw_ctx.__exit__(None, None, None)
        if killed:
            start_again(victim)
            cluster.make_master_again(victim, QUEUE_KEY)


def test_three_seeds_the_first_dead_at_start(cluster, tiny_model, tiny_model_dir, tmp_path):
    """A URL naming three seeds, the first already dead: the client and the worker start from
    the others (cluster mode is never guessed from the dead one)."""
    first = cluster.masters[0]
    others = [n for n in cluster.masters if n is not first]
    first.kill()
    cluster.wait_ok(60, nodes=[n for n in cluster.nodes if n is not first])
    url = _seed_url([first] + others)
    worker = WorkerProc(url, tiny_model_dir, tmp_path, max_batch=8)
    try:
        assert wait_registered(url, timeout=120), worker.log()
        client = Client(url, model="tiny", settings=fast_settings(url))
        p = _prompts(1)[0]
        job = client.submit(prompt_tokens=p, max_tokens=8, ignore_eos=True)
        streamed = [t for d in job.stream(timeout=120) for t in d.token_ids]
        assert streamed == job.result(timeout=120).token_ids == reference_tokens(tiny_model, p, 8, ignore_eos=True)
        client.close()
    finally:
        worker.stop()


def test_every_node_stopped_result_times_out_then_the_same_client_works_again(cluster, tmp_path):
    """No wait without an end: with every node down, result(timeout=5) raises a ConnectionError
    naming the nodes (after about 5 s); once the nodes are back the same client works."""
    from mlxq.shared.connection import RedisUnreachable

    url = _seed_url(cluster.masters)
    client = Client(url, model="tiny", settings=fast_settings(url, redis_outage_s=5.0))
    job = client.submit(prompt_tokens=[5, 6, 7], max_tokens=4)  # no worker: it stays queued
    ports = [n.port for n in cluster.nodes]
    for n in cluster.nodes:
        n.kill()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        job.result(timeout=5)
    took = time.monotonic() - t0
    assert isinstance(info.value, RedisUnreachable) and str(cluster.masters[0].port) in str(info.value)
    assert took < 60  # a hang guard, not a speed check: the wait ends (about 5 s, plus a connect attempt in flight)
    for n in cluster.nodes:
        start_again(n)
    assert [n.port for n in cluster.nodes] == ports
    cluster.wait_ok(60)
    # the nodes kept no data (no AOF): the same client serves a new job
    assert client.submit(prompt_tokens=[5, 6, 7], max_tokens=4).status().startswith("queued")
    client.close()


# -- refusals say when to come back -----------------------------------------------------------------------
def _post(url: str, body: dict):
    """(status, headers, body) of a POST, errors included."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.headers, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read() or b"{}")


def test_gateway_503_with_retry_after_only_past_the_outage_limit(tmp_path):
    """Redis gone for good: a request waits out ``redis_outage_s`` (a pause, not an error), then
    gets 503 with Retry-After; no 500."""
    from mlxq.producer.gateway import ServerThread, create_app

    srv = EmbeddedRedis(tmp_path / "data").start()
    try:
        settings = fast_settings(srv.url, redis_outage_s=2.0)
        with ServerThread(create_app(srv.url, settings)) as gw:
            srv.kill()
            t0 = time.monotonic()
            status, headers, body = _post(f"{gw}/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
            waited = time.monotonic() - t0
            assert status == 503 and int(headers["Retry-After"]) >= 1, (status, body)
            assert body["error"]["code"] == "redis_unavailable" and str(srv.port) in body["error"]["message"]
            assert waited >= 1.0  # it retried first (a retry that would end past the limit is not begun)
    finally:
        with contextlib.suppress(Exception):
            srv.stop()


def test_gateway_429_carries_retry_after(tiny_model, redis_url):
    """A full tier queue: 429 with Retry-After (from the queue's drain rate once known)."""
    from mlxq.producer.gateway import ServerThread, create_app
    from mlxq.shared import apikeys
    from mlxq.shared.keys import GlobalKeys
    from workerkit import running_worker

    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    apikeys.set_policy(client.redis, GlobalKeys(), max_queued=1)
    with running_worker(tiny_model, redis_url, settings, max_batch=1), \
            ServerThread(create_app(redis_url, settings)) as gw:
        assert wait_registered(redis_url)
        running = client.submit(prompt_tokens=[5, 6, 7], max_tokens=2000, ignore_eos=True)  # holds the worker
        assert wait_for(lambda: running.status() == "running", timeout=60)
        queued = client.submit(prompt_tokens=[5, 6, 8], max_tokens=4, ignore_eos=True)  # fills the tier
        statuses = []
        for _ in range(3):
            status, headers, body = _post(f"{gw}/v1/completions", {"model": "tiny", "prompt": [5], "max_tokens": 2})
            statuses.append(status)
            assert status == 429 and 1 <= int(headers["Retry-After"]) <= 60, (status, body)
        running.cancel()
        queued.cancel()
    client.close()


def test_a_begun_stream_whose_redis_leaves_for_good_ends_with_an_error_event_not_a_500(tmp_path, tiny_model_dir,
                                                                                      caplog):
    """Redis killed for good under a stream that has begun: past ``redis_outage_s`` the stream ends as
    OpenAI ends one, with an error event (503 redis_unavailable) and no ``[DONE]``; the gateway logs no
    ASGI exception (a 500 after the headers went out)."""
    import json
    import logging
    import urllib.request

    from mlxq.producer.gateway import ServerThread, create_app

    srv = EmbeddedRedis(tmp_path / "data").start()
    worker = WorkerProc(srv.url, tiny_model_dir, tmp_path)
    try:
        settings = fast_settings(srv.url, redis_outage_s=2.0)
        assert wait_registered(srv.url)
        caplog.set_level(logging.WARNING)
        with ServerThread(create_app(srv.url, settings)) as gw:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            req = urllib.request.Request(f"{gw}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                assert resp.status == 200
                events = []
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 1:  # the stream has begun: Redis goes, and the worker with it
                        worker.kill9()
                        srv.kill()
        assert len(events) > 1 and "[DONE]" not in events
        last = json.loads(events[-1])
        assert last["error"]["code"] == "redis_unavailable", last
        assert all("choices" in json.loads(e) for e in events[:-1])
        assert "Exception in ASGI application" not in caplog.text and "Traceback" not in caplog.text
    finally:
        worker.stop()
        with contextlib.suppress(Exception):
            srv.stop()
