"""Faults on a real Valkey server the tests start: kill -9 of a worker, Redis restarts (graceful
and SIGKILL, AOF fsync always), SIGTERM warm/cold shutdown, a producer that dies after enqueue,
and overload.  Each test prints a FIGURES line (submitted, completed, lost, duplicated)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
import redis

from mlxq import Client, OverloadError
from mlxq.shared import apikeys
from mlxq.shared.embedded import EmbeddedRedis
from mlxq.shared.keys import GlobalKeys, ModelKeys
from workerkit import fast_settings, neutral_cwd, running_worker, wait_for
from faultkit import (StepGate, WorkerProc, _check_results, _specs, _xlen, record, reference_tokens,
                      submit_and_follow, wait_registered, worker_env)

K = ModelKeys("tiny")


def _refs(loaded, specs):
    return [reference_tokens(loaded, p, n, ignore_eos=ie) for p, n, ie in specs]


def test_worker_kill9_mid_stream_loses_and_duplicates_nothing(tiny_model, tiny_model_dir, redis_url, tmp_path):
    # the jobs that ignore EOS run 400 tokens: a worker that publishes late (deltas of several
    # steps each, on a loaded machine) still has them running when each has streamed 4 entries
    specs = [(p, 400 if ie else n, ie) for p, n, ie in _specs(11, 14, 160)]
    refs = _refs(tiny_model, specs)
    lease = dict(lease_s=2, heartbeat_s=0.5)
    settings = fast_settings(redis_url, **lease)
    client = Client(redis_url, model="tiny", settings=settings)
    r = client.redis
    a = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=16, **lease)
    b = None
    try:
        assert wait_registered(redis_url), a.log()
        # frozen while the jobs go in: a loaded machine's slow submits would otherwise give it time to
        # finish them all before the first look
        a.freeze()
        jobs, collectors = submit_and_follow(client, specs)
        # kill -9 once every job has streamed a few deltas (or already finished: the ones that may
        # stop at EOS). Freeze the worker first so the states read below are the states at the kill.
        # (the worker runs in short slices meanwhile and is frozen when the condition holds)
        assert a.run_until(lambda: all(_xlen(r, j.id) >= 4 or j.status() == "done" for j in jobs)), a.log()
        at_kill = {j.id: (j.status(), _xlen(r, j.id)) for j in jobs}
        running_at_kill = [jid for jid, (st, _) in at_kill.items() if st == "running"]
        a.kill9()
        # the jobs that ignore EOS are long by construction (400 tokens; they had streamed only a
        # few entries when the condition above held), so each of them is hit mid-stream
        long_ids = {j.id for j, (_, _, ie) in zip(jobs, specs) if ie}
        assert long_ids <= set(running_at_kill), f"a long job was not running at the kill: {at_kill}"
        b = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=16, **lease)
        results = [j.result(timeout=90) for j in jobs]
        for c in collectors:
            c.join(timeout=30)
        ok, lost, dup = _check_results(tiny_model, results, refs, collectors)
        counts = client.queue_for("tiny").counts()
        for res in results:
            assert res.stats.attempts == (2 if res.id in running_at_kill else 1), res.id
        record("worker kill -9 (14 streaming jobs)", len(jobs), ok, lost, dup + max(0, counts["done"] - len(jobs)),
               running_at_kill=len(running_at_kill), reaped=counts.get("requeued", 0))
        assert (ok, lost, dup) == (len(jobs), 0, 0)
        assert counts["done"] == counts["processed"] == len(jobs) and counts["running"] == 0
        assert counts["requeued"] == len(running_at_kill)
    finally:
        a.stop()
        if b:
            b.stop()


_RESTART_REFS: dict = {}


@pytest.mark.parametrize("hard", [False, True], ids=["graceful", "sigkill"])
def test_redis_restart_mid_run_keeps_active_jobs(tiny_model, tmp_path, hard, caplog):
    # the jobs that ignore EOS are long (300 tokens) and are held mid-run at the restart by
    # construction: the worker's MLX thread waits at a StepGate from the moment every job has made
    # a few tokens (or finished) until Redis is back, however fast the machine or the weights
    specs = [(p, 300 if ie else 40, ie) for p, _, ie in _specs(21, 12, 0)]
    if "refs" not in _RESTART_REFS:
        _RESTART_REFS["refs"] = _refs(tiny_model, specs)
    refs = _RESTART_REFS["refs"]
    caplog.set_level(logging.WARNING)
    srv = EmbeddedRedis(tmp_path / "data", persist=True).start()
    try:
        url = srv.url
        # leases and the takeover judged far longer than a loaded machine's stall: a job this worker
        # lost to a lapsed lease or a stale heartbeat before the hold would not be "kept" (another
        # test covers those)
        settings = fast_settings(url, lease_s=60.0, takeover_s=60.0)
        client = Client(url, model="tiny", settings=settings)
        r = client.redis
        with running_worker(tiny_model, url, settings, max_batch=16) as w, StepGate(w.engine) as gate:
            jobs, collectors = submit_and_follow(client, specs)
            gate.hold_when([j.id for j in jobs], 3)
            assert gate.held.wait(timeout=120)
            active_before = set(w.active)
            t0 = time.monotonic()
            srv.restart(hard=hard)
            down_s = time.monotonic() - t0
            gate.release()
            results = [j.result(timeout=90) for j in jobs]
            for c in collectors:
                c.join(timeout=30)
            # the worker reconnected: it pulls and publishes again after the restart
            after = client.submit(prompt_tokens=[5, 6, 7], max_tokens=3).result(timeout=30)
            assert after.finish_reason in ("stop", "length")
            assert w.fetcher.is_alive() and w.control.is_alive() and w.publisher.is_alive()
        ok, lost, dup = _check_results(tiny_model, results, refs, collectors)
        counts = client.queue_for("tiny").counts()
        kept = sum(1 for res in results if res.id in active_before and res.stats.attempts == 1)
        retries = [rec.getMessage() for rec in caplog.records if "retrying in" in rec.getMessage()]
        record(f"redis restart ({'SIGKILL' if hard else 'graceful'}, AOF always)", len(jobs), ok, lost,
               dup + max(0, counts.get("done", 0) - len(jobs) - 1), active_at_restart=len(active_before),
               kept_by_worker=kept, outage_s=round(down_s, 2), worker_backoff_retries=len(retries))
        assert (ok, lost, dup) == (len(jobs), 0, 0)
        # the worker kept every job it had active at the restart (no new attempt); every long job
        # was among them (how many short ones were still active depends on timing)
        long_ids = {j.id for j, (_, _, ie) in zip(jobs, specs) if ie}
        assert kept == len(active_before) and long_ids <= active_before
        assert counts["done"] == len(jobs) + 1 and counts["running"] == 0
        # every retry delay the worker logged is capped (Backoff cap 5 s)
        for msg in retries:
            assert float(msg.rsplit("retrying in ", 1)[1].split("s")[0]) <= 5.0
        client.close()
    finally:
        srv.stop()


def test_backoff_is_capped():
    from mlxq.shared.linkwatch import Backoff

    b = Backoff(first=0.05, cap=5.0)
    delays = [b.fail() for _ in range(200)]
    # full jitter: each delay drawn under its capped exponential ceiling, so workers retry apart
    assert all(0 <= d <= min(5.0, 0.05 * 2 ** i) for i, d in enumerate(delays))
    assert len(set(delays)) > 100 and max(delays) > 2.5
    b.ok()
    assert b.fail() <= 0.05
    b.failures = 5000  # an outage of hours: still a delay under the cap (2**5000 overflowed a float)
    assert 0 <= b.fail() <= 5.0


def test_producer_dies_after_enqueue_and_the_job_still_runs(tiny_model, redis_url):
    prompt = [9, 8, 7, 6, 5]
    ref = reference_tokens(tiny_model, prompt, 12)
    code = ("import os, sys\n"
            "from mlxq import Client\n"
            f"j = Client({redis_url!r}, model='tiny').submit(prompt_tokens={prompt!r}, max_tokens=12)\n"
            "print(j.id, flush=True)\n"
            "os._exit(0)  # gone at once: no cleanup, no waiting\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=neutral_cwd(), env=worker_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip()
    client = Client(redis_url, model="tiny", settings=fast_settings(redis_url))
    assert client.job(job_id).status().startswith("queued")  # (", no live worker for tiny")
    with running_worker(tiny_model, redis_url, fast_settings(redis_url)):
        res = client.job(job_id).result(timeout=60)
    assert res.token_ids == ref and res.finish_reason in ("stop", "length")
    assert client.redis.ttl(K.job(job_id)) > 3600  # the result is kept (result_ttl_s)
    later = Client(redis_url, model="tiny").job(job_id).result(timeout=5)
    assert later.text == res.text
    record("producer exits after enqueue", 1, 1, 0, 0)


def test_sigterm_finishes_or_requeues_and_a_second_sigterm_exits_at_once(tiny_model, tiny_model_dir,
                                                                           redis_url, tmp_path):
    """Each phase is decided by construction, not by how fast the worker runs: a grace of 0
    requeues whatever runs, a long grace finishes whatever runs, and the jobs that must still be
    running at the second SIGTERM are far longer than the moment between the two signals."""
    long = _specs(32, 3, 300, ignore_eos_every=1)
    short = _specs(31, 3, 40, ignore_eos_every=1)
    cold = _specs(33, 3, 400, ignore_eos_every=1)
    refs = _refs(tiny_model, long + short + cold)
    lease = dict(lease_s=2, heartbeat_s=0.5)
    client = Client(redis_url, model="tiny", settings=fast_settings(redis_url, **lease))
    r = client.redis
    procs = []
    try:
        # 1. warm shutdown with no grace left: the running jobs are requeued with their resume state
        #    (same attempt: the stream continues where it stopped)
        w1 = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=16, grace=0.0, **lease)
        procs.append(w1)
        assert wait_registered(redis_url), w1.log()
        long_jobs, collectors = submit_and_follow(client, long)
        assert wait_for(lambda: all(_xlen(r, j.id) >= 3 for j in long_jobs), timeout=120), w1.log()
        w1.term()
        assert w1.wait(timeout=60) == 0, w1.log()
        assert all(j.status().startswith("queued") for j in long_jobs), w1.log()
        assert all(r.hget(K.job(j.id), "resume") for j in long_jobs)  # resume state kept

        # 2. a second worker resumes them; short jobs join; a SIGTERM with a long grace lets every
        #    running job finish (the requeued ones from their resume state) before it exits
        w2 = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=16, grace=600.0, **lease)
        procs.append(w2)
        short_jobs, short_collectors = submit_and_follow(client, short)
        assert wait_for(lambda: all(_xlen(r, j.id) >= 3 for j in short_jobs), timeout=120), w2.log()
        w2.term()
        assert w2.wait(timeout=300) == 0, w2.log()
        assert all(j.status() == "done" for j in long_jobs + short_jobs), w2.log()
        res_long = [j.result(timeout=5) for j in long_jobs]
        w2_id = res_long[0].stats.worker
        assert all(x.stats.attempts == 1 and x.stats.worker == w2_id for x in res_long)

        # 3. a second SIGTERM exits at once, mid-job; the leases bring the jobs back
        w3 = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=16, grace=600.0, **lease)
        procs.append(w3)
        cold_jobs, cold_collectors = submit_and_follow(client, cold)
        assert wait_for(lambda: all(_xlen(r, j.id) >= 3 for j in cold_jobs), timeout=120), w3.log()
        w3.term()
        assert w3.wait_log("warm shutdown"), w3.log()  # the first signal was taken
        t0 = time.monotonic()
        w3.term()
        assert w3.wait(timeout=60) == 1, w3.log()
        cold_exit_s = time.monotonic() - t0
        assert all(j.status() == "running" for j in cold_jobs), w3.log()  # left behind on purpose
        w4 = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=16, **lease)
        procs.append(w4)
        res_cold = [j.result(timeout=180) for j in cold_jobs]
        assert all(x.stats.attempts == 2 for x in res_cold)

        results = res_long + [j.result(timeout=5) for j in short_jobs] + res_cold
        all_collectors = collectors + short_collectors + cold_collectors
        for c in all_collectors:
            c.join(timeout=60)
        ok, lost, dup = _check_results(tiny_model, results, refs, all_collectors)
        counts = client.queue_for("tiny").counts()
        record("SIGTERM grace 0 (3 requeued) + long grace (6 finish) + second SIGTERM (3 mid-job)",
               len(results), ok, lost, dup + max(0, counts["done"] - len(results)),
               cold_exit_s=round(cold_exit_s, 2))
        assert (ok, lost, dup) == (len(results), 0, 0)
        assert counts["done"] == len(results) and counts["running"] == 0
    finally:
        for p in procs:
            p.stop()


def test_overload_refuses_at_once_without_growing_redis(redis_url):
    bound = 40
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    r = client.redis
    apikeys.set_policy(r, GlobalKeys(), max_queued=bound)  # the bound lives in Redis (`mlxq tiers`)
    accepted = [client.submit(prompt_tokens=[5, 6], max_tokens=2) for _ in range(bound)]

    def refuse():
        t = time.perf_counter()
        with pytest.raises(OverloadError):
            client.submit(prompt_tokens=[5, 6, 7, 8], max_tokens=2)
        return time.perf_counter() - t

    # warm up (connections, script cache, the server's own tables) until the dataset size settles
    last = None
    for _ in range(8):
        for _ in range(500):
            refuse()
        now = int(r.info("memory")["used_memory_dataset"])
        if now == last:
            break
        last = now
    m0 = r.info("memory")
    keys0 = r.dbsize()
    sizes0 = {k: r.memory_usage(k, samples=0) for k in r.scan_iter()}
    times = sorted(refuse() for _ in range(2000))
    m1 = r.info("memory")
    keys1 = r.dbsize()
    sizes1 = {k: r.memory_usage(k, samples=0) for k in r.scan_iter()}
    growth = int(m1["used_memory"]) - int(m0["used_memory"])
    data_growth = int(m1["used_memory_dataset"]) - int(m0["used_memory_dataset"])
    # another tier is not blocked by a full one; what 40 accepted jobs cost, for comparison
    apikeys.add_key(r, GlobalKeys().api_keys, "overload-high-key", "high")
    high = Client(redis_url, api_key="overload-high-key", model="tiny", settings=settings)
    used2 = int(r.info("memory")["used_memory"])
    assert all(high.submit(prompt_tokens=[5, 6, 7, 8], max_tokens=2).status().startswith("queued")
               for _ in range(bound))
    per_job = (int(r.info("memory")["used_memory"]) - used2) / bound
    print(f"\nFIGURES overload: bound={bound}, refused=2000 after warm-up, median_refusal_ms={times[1000]*1e3:.2f}, "
          f"p99_ms={times[1980]*1e3:.2f}, used_memory_growth_bytes={growth} (dataset {data_growth}; 2000 refused), "
          f"accepted_job_bytes={per_job:.0f}, keys {keys0}->{keys1}")
    assert keys1 == keys0 and sizes1 == sizes0  # nothing stored for refused jobs: no key, no byte
    # what remains is the scripting VM's not-yet-collected garbage (~12 B a call, it plateaus),
    # not data: 2000 stored jobs would be ~2.3 MB
    assert growth < 0.1 * 2000 * per_job  # no growth once warm (2000 stored jobs would be ~2 MB)
    # (how fast a refusal is, is a figure printed above, not an assertion: it depends on the machine)
    assert client.queue_for("tiny").counts()["queued:normal"] == bound == len(accepted)


def test_a_retried_enqueue_after_a_lost_reply_is_the_same_job(redis_url):
    """redis-py retries a command whose reply was lost (e.g. Redis restarted): the second enqueue of
    the same request must return the job, not 'already exists'."""
    from mlxq.shared.protocol import JobRefused, Queue

    r = redis.Redis.from_url(redis_url)
    q = Queue(r, K, fast_settings(redis_url))
    job_id = "c" * 32
    first = q.enqueue(job_id, b"same request", global_redis=r)
    again = q.enqueue(job_id, b"same request", global_redis=r)
    assert (again.status, again.job_id, again.score) == ("ok", job_id, first.score)
    assert q.counts()["submitted"] == 1 and r.zcard(K.queue) == 1
    with pytest.raises(JobRefused):  # a different request under a taken id is still refused
        q.enqueue(job_id, b"another request", global_redis=r)


def _worker_with_step(tiny_model, redis_url, settings, step):
    """A worker (in this process) whose engine step is ``step(worker, real_step)``."""
    from mlxq.worker.runner import Worker

    w = Worker(redis.Redis.from_url(redis_url), tiny_model, settings)
    real_step = w.engine.step
    w.engine.step = lambda: step(w, real_step)
    return w


def test_a_job_that_fails_every_worker_ends_dead_lettered_with_its_error(tiny_model, redis_url):
    """A job that makes the engine raise (here a step raises whenever it holds that job) does not go
    round the workers for ever: each worker it fails stops, as an engine failure leaves the engine's
    state unknown, and gives it back with the attempt counted; at max_attempts the job is
    dead-lettered with the error, its caller gets that error, and a fresh worker serves the queue."""
    settings = fast_settings(redis_url, max_attempts=2)
    client = Client(redis_url, model="tiny", settings=settings)
    poison = client.submit(prompt_tokens=[3, 1, 4, 1, 5], max_tokens=8)

    def step(w, real_step):
        if any(j.id == poison.id for j in w.active.values()):
            raise RuntimeError("boom in a step")
        return real_step()

    for attempt in (1, 2):
        w = _worker_with_step(tiny_model, redis_url, settings, step)
        with pytest.raises(RuntimeError, match="boom in a step"):
            w.run(burst=True)
        assert w.processed["abandoned"] == 1 and w.processed["requeued"] == 0
        h = client.redis.hgetall(K.job(poison.id))
        if attempt == 1:  # back in the queue at once (this worker reaped it), the attempt counted
            assert h[b"status"] == b"queued" and h[b"attempts"] == b"1", h
            assert client.redis.zscore(K.queue, poison.id) is not None
    res = poison.result(timeout=30)
    assert res.finish_reason == "error", res
    assert "2 attempts" in res.error and "RuntimeError: boom in a step" in res.error, res.error
    assert client.redis.zscore(K.dead, poison.id) is not None
    assert client.redis.zcard(K.inflight) == 0 and client.redis.zcard(K.queue) == 0
    other = client.submit(prompt_tokens=[2, 7, 1, 8], max_tokens=5)
    with running_worker(tiny_model, redis_url, settings):
        assert other.result(timeout=60).finish_reason in ("stop", "length")


def test_a_job_given_back_by_a_failed_engine_runs_alone_so_its_batch_mate_completes(tiny_model, redis_url):
    """The jobs an engine held when it raised are suspects: the next worker runs each alone. Here the
    step raises whenever the poison job is in it. The first worker holds it with an innocent job, so
    both go back with the attempt counted; had the next worker batched them again, the innocent one
    would share the poison's last attempt and be dead-lettered with it (max_attempts=2). Alone, the
    poison fails for itself (dead, with its error) and the innocent one completes, its tokens the
    greedy answer for its prompt; no engine ever held a suspect with another job."""
    settings = fast_settings(redis_url, max_attempts=2)
    client = Client(redis_url, model="tiny", settings=settings)
    poison = client.submit(prompt_tokens=[3, 1, 4, 1, 5], max_tokens=8)
    innocent_prompt = [2, 7, 1, 8, 2, 8]
    innocent = client.submit(prompt_tokens=innocent_prompt, max_tokens=12, ignore_eos=True)
    batches: list[set] = []
    # the second worker fails only once the innocent job is in its hands: in its engine (as a worker
    # without isolation would batch it), or held back in its ready queue for 3 of the poison's steps
    second = {"seen": False, "held_back": 0, "until": time.monotonic() + 30}
    for n in (1, 2, 3):

        def step(w, real_step, n=n):
            held = {j.id for j in w.active.values()}
            batches.append((n, frozenset(held)))
            if poison.id in held:
                if n == 1 and innocent.id not in held:
                    return [], []  # the first worker fails with both in its engine
                if n == 2 and innocent.id not in held:
                    waiting = any(j.id == innocent.id for j in list(w.ready.items))
                    second["seen"] |= waiting
                    second["held_back"] = second["held_back"] + 1 if waiting else 0
                    if (waiting and second["held_back"] < 3) or (
                            not second["seen"] and time.monotonic() < second["until"]):
                        return [], []
                raise RuntimeError("boom in a step")
            if n == 2 and innocent.id in held:
                second["seen"] = True  # the innocent job ran first (alone)
            return real_step()

        w = _worker_with_step(tiny_model, redis_url, settings, step)
        if n < 3:
            with pytest.raises(RuntimeError, match="boom in a step"):
                w.run(burst=True)
        else:
            w.run(burst=True)
        if n == 1:  # both given back with the attempt counted and the failure kept
            assert w.processed["abandoned"] == 2, w.processed
            for job in (poison, innocent):
                h = client.redis.hgetall(K.job(job.id))
                assert h[b"status"] == b"queued" and h[b"attempts"] == b"1" and b"boom" in h[b"error"], h
    res = poison.result(timeout=30)
    assert res.finish_reason == "error" and "2 attempts" in res.error, res
    ok = innocent.result(timeout=30)
    assert ok.finish_reason == "length", ok
    assert ok.token_ids == reference_tokens(tiny_model, innocent_prompt, 12, ignore_eos=True)
    assert second["seen"], "the second worker never had the innocent job in its hands"
    later = [held for n, held in batches if n > 1 and held]
    assert later and all(len(held) == 1 for held in later), batches
    assert client.redis.zcard(K.inflight) == 0 and client.redis.zcard(K.queue) == 0


def test_admit_now_runs_a_suspect_alone_and_never_strands_a_running_jobs_samples():
    from types import SimpleNamespace as J

    from mlxq.worker.jobs import admit_now

    a, b, s0, s1, t = J(id="a", suspect=""), J(id="b", suspect=""), J(id="s", suspect="boom"), \
        J(id="s", suspect="boom"), J(id="t", suspect="boom")
    assert admit_now([a, b], []) == ([a, b], False)
    assert admit_now([b], [a]) == ([b], False)
    # a suspect waits while the engine drains; a running job's preempted sample still goes back in
    a2 = J(id="a", suspect="")
    assert admit_now([s0, s1, a2, b], [a]) == ([a2], True)
    # drained: the suspect's samples alone; the next suspect and the others wait
    assert admit_now([b, s0, t, s1], []) == ([s0, s1], True)
    # running alone: only its own samples join it
    assert admit_now([t, b, s1], [s0]) == ([s1], True)


def test_a_job_pulled_while_the_worker_stops_goes_back_at_once(tiny_model, redis_url):
    """A stop that comes while the fetcher is between a pull and handing the job over (tokenizing it)
    waits for it, so the job goes back with the others, its attempt given back. Before, it stayed
    leased to the stopped worker until the lease expired, and the reaper then counted an attempt."""
    import threading

    from mlxq.worker.runner import Worker

    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    w = Worker(redis.Redis.from_url(redis_url), tiny_model, settings)
    real_prepare, pulled = w.fetcher.prepare, threading.Event()

    def prepare(entry):
        pulled.set()
        time.sleep(0.5)  # the stop below lands while this job is leased but not yet ready
        real_prepare(entry)

    w.fetcher.prepare = prepare
    job = client.submit(prompt_tokens=[5, 6, 7], max_tokens=4)
    t = threading.Thread(target=w.run)
    t.start()
    assert pulled.wait(30)
    w.request_stop(0)
    t.join(60)
    assert not t.is_alive()
    h = client.redis.hgetall(K.job(job.id))
    assert h[b"status"] == b"queued" and h[b"attempts"] == b"0", h
    assert client.redis.zcard(K.inflight) == 0 and client.redis.zscore(K.queue, job.id) is not None


def test_a_job_whose_host_step_raises_ends_alone_and_the_worker_serves_on(tiny_model, redis_url):
    """What handling one job's tokens raises on the host thread (a tool parser, the detokenizer)
    ends that job with an internal error; its batch-mate completes with the greedy answer and the
    worker serves on. Before, the exception stopped the worker and every job it held went back."""
    from mlxq.shared.schemas import INTERNAL_ERROR
    from mlxq.worker.runner import Worker

    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    poison = client.submit(prompt_tokens=[3, 1, 4, 1, 5], max_tokens=8)
    prompt = [2, 7, 1, 8, 2, 8]
    innocent = client.submit(prompt_tokens=prompt, max_tokens=12, ignore_eos=True)
    w = Worker(redis.Redis.from_url(redis_url), tiny_model, settings)
    real = w.host._take_event

    def take_event(job, ev, top, out):
        if job.id == poison.id and job.tokens:
            raise TypeError("Object of type set is not JSON serializable")
        return real(job, ev, top, out)

    w.host._take_event = take_event
    w.run(burst=True)  # returns: the worker did not stop on it
    res = poison.result(timeout=30)
    assert res.finish_reason == "error" and res.error_code == INTERNAL_ERROR and "JSON serializable" in res.error
    ok = innocent.result(timeout=30)
    assert ok.finish_reason == "length" and ok.token_ids == reference_tokens(tiny_model, prompt, 12, ignore_eos=True)
    assert client.redis.zcard(K.inflight) == 0 and w.engine.stats()["running"] == 0


def test_a_result_over_the_readers_limit_ends_the_job_with_an_error_that_says_so(tiny_model, redis_url,
                                                                                 monkeypatch):
    """A result larger than a reader takes (codec.MAX_MESSAGE_BYTES; here lowered, so that a short
    job with log-probabilities passes it) ends the job with an error naming the size, its final
    delta too: the caller got "done" and then only a CodecError reading it. 48 tokens with five
    alternatives each pass the limit whatever the text (every token's log-probabilities take 85 bytes
    and more); 16 did only with the text some weights give."""
    from mlxq.shared import codec

    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    big = client.submit(prompt_tokens=[3, 1, 4], max_tokens=48, ignore_eos=True, logprobs=5)
    small = client.submit(prompt_tokens=[3, 1, 4], max_tokens=2, ignore_eos=True)
    monkeypatch.setattr(codec, "MAX_MESSAGE_BYTES", 2000)
    with running_worker(tiny_model, redis_url, settings):
        res = big.result(timeout=60)
        assert res.finish_reason == "error" and "over the 2,000 a result may be" in res.error, res
        [(_, last)] = client.redis.xrevrange(K.events(big.id), count=1)
        assert codec.unpack(last[b"d"])["f"] == "error"
        assert small.result(timeout=60).finish_reason == "length"


def test_a_worker_whose_io_thread_died_stops(tiny_model, redis_url):
    """An I/O thread that died anyway (a bug past every guard) leaves a worker that looks alive and
    serves nothing: the worker stops with an error, as when its engine fails."""
    from mlxq.worker.runner import Worker

    import threading

    w = Worker(redis.Redis.from_url(redis_url), tiny_model, fast_settings(redis_url))
    w.control.run = lambda: None  # the thread ends at once
    raised = []

    def serve():
        try:
            w.run()
        except RuntimeError as exc:
            raised.append(str(exc))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():  # (it served on for ever before)
        w.request_stop(grace_s=0)
        t.join(30)
    assert raised and "mlxq-control thread died" in raised[0], raised


def test_jobs_of_a_pull_are_renewed_while_it_is_prepared(tiny_model, redis_url):
    """A pull's jobs are leased before they are prepared one by one (tokenizing large prompts can
    take longer than a lease): the heartbeat renews the ones still waiting their turn. Here the
    first job's preparing waits until the second's lease is renewed; before, it never was."""
    import threading

    from mlxq.worker.runner import Worker

    settings = fast_settings(redis_url, lease_s=2.0, heartbeat_s=0.2)
    client = Client(redis_url, model="tiny", settings=settings)
    first = client.submit(prompt_tokens=[3, 1, 4], max_tokens=2)
    second = client.submit(prompt_tokens=[2, 7, 1], max_tokens=2)
    w = Worker(redis.Redis.from_url(redis_url), tiny_model, settings)
    real, renewed = w.fetcher.prepare, threading.Event()

    def prepare(entry):
        if entry.job_id == first.id:
            leased = client.redis.zscore(K.inflight, second.id)
            renewed.set() if wait_for(lambda: (client.redis.zscore(K.inflight, second.id) or 0) > leased,
                                      timeout=30) else None
        return real(entry)

    w.fetcher.prepare = prepare
    w.run(burst=True)
    assert renewed.is_set()
    for job in (first, second):
        res = job.result(timeout=30)
        assert res.finish_reason in ("stop", "length") and res.stats.attempts == 1, res
