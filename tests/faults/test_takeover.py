"""A dead or stuck worker's jobs move to a live worker within a few heartbeats, long before their
leases run out: two ``mlxq worker`` subprocesses on a real Valkey, leases of two minutes and a
heartbeat of half a second. What is asserted is the order of events (every job of the dead worker
runs and finishes on the other before the lease it held could have expired); the seconds from the
kill to the takeover are printed in the FIGURES line."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

from mlxq import Client
from mlxq.shared.keys import ModelKeys
from workerkit import fast_settings, wait_for
from faultkit import (WorkerProc, _check_results, _specs, _xlen, record, reference_tokens, submit_and_follow,
                      wait_registered)

K = ModelKeys("tiny")
LEASE = dict(lease_s=120, heartbeat_s=0.5, takeover_s=1.25)  # takeover after 2.5 beats (the default)


def _worker_id(r, proc) -> str:
    """A worker subprocess's id (``<host>-<pid>-<hex>``) from the registry."""
    [wid] = [w.decode() for w in r.zrange(K.workers, 0, -1) if f"-{proc.pid}-" in w.decode()]
    return wid


def _held_by(r, jobs, wid) -> list:
    return [j for j in jobs if r.hget(K.job(j.id), "worker") == wid.encode()
            and r.hget(K.job(j.id), "status") == b"running"]


def _two_workers(url, model_dir, tmp_path, **extra):
    a = WorkerProc(url, model_dir, tmp_path, max_batch=3, **LEASE, **extra)
    b = WorkerProc(url, model_dir, tmp_path, max_batch=3, **LEASE)
    return a, b


@contextlib.contextmanager
def _a_frozen_mid_stream(tiny_model, tiny_model_dir, url, tmp_path, seed):
    """Workers A and B (max_batch 3 each) run six 300-token jobs; A is left frozen (SIGSTOP) once each
    of its three jobs (the victims) streamed a few deltas."""
    specs = [(p, 300, True) for p, _, _ in _specs(seed, 6, 300)]
    t = SimpleNamespace(refs=[reference_tokens(tiny_model, p, n, ignore_eos=ie) for p, n, ie in specs],
                        client=Client(url, model="tiny", settings=fast_settings(url, **LEASE)))
    t.r = r = t.client.redis
    t.a, t.b = _two_workers(url, tiny_model_dir, tmp_path)
    try:
        assert wait_registered(url, n=2), t.a.log() + t.b.log()
        t.a_id, t.b_id = _worker_id(r, t.a), _worker_id(r, t.b)
        t.jobs, t.collectors = submit_and_follow(t.client, specs)
        assert t.a.run_until(lambda: len(_held_by(r, t.jobs, t.a_id)) == 3
                             and all(_xlen(r, j.id) >= 3 for j in _held_by(r, t.jobs, t.a_id))), t.a.log()
        t.victims = _held_by(r, t.jobs, t.a_id)
        yield t
    finally:
        t.a.stop()
        t.b.stop()


def _taken_by_b(t) -> bool:
    return wait_for(lambda: all(t.r.hget(K.job(j.id), "worker") == t.b_id.encode() for j in t.victims),
                    timeout=60, interval=0.01)


def _results(tiny_model, t):
    results = [j.result(timeout=120) for j in t.jobs]
    for c in t.collectors:
        c.join(timeout=30)
    return results, _check_results(tiny_model, results, t.refs, t.collectors)


def test_a_killed_workers_jobs_are_taken_over_long_before_their_leases_expire(tiny_model, tiny_model_dir,
                                                                            redis_url, tmp_path):
    with _a_frozen_mid_stream(tiny_model, tiny_model_dir, redis_url, tmp_path, 66) as t:
        sec, usec = t.r.time()
        killed_at = sec + usec / 1e6
        deadlines = {j.id: t.r.zscore(K.inflight, j.id) for j in t.victims}
        assert all(d > killed_at + 60 for d in deadlines.values())  # their leases run for minutes yet
        t.a.kill9()
        t_kill = time.monotonic()
        assert _taken_by_b(t), t.b.log()
        takeover_s = time.monotonic() - t_kill
        results, (ok, lost, dup) = _results(tiny_model, t)
        by_id = {res.id: res for res in results}
        for j in t.victims:
            res = by_id[j.id]
            # run and finished by B, before the lease A held could have expired
            assert res.stats.worker == t.b_id and res.stats.attempts == 2, res.stats
            assert res.stats.started_at < res.stats.finished_at < deadlines[j.id]
        assert "of a worker whose heartbeat was overdue" in t.b.log()  # taken over, not expired
        record("worker kill -9, lease 120 s, heartbeat 0.5 s (3 of 6 jobs taken over)", len(t.jobs), ok, lost,
               dup, kill_to_takeover_s=round(takeover_s, 2),
               kill_to_first_resumed_start_s=round(min(by_id[j.id].stats.started_at for j in t.victims) - killed_at, 2))
        assert (ok, lost, dup) == (len(t.jobs), 0, 0)


def test_a_worker_judged_dead_while_only_slow_loses_those_jobs_and_serves_on(tiny_model, tiny_model_dir,
                                                                           redis_url, tmp_path):
    """SIGSTOP past the takeover: B takes A's jobs; A, thawed, has its late writes refused, logs that
    its heartbeat was late and that it dropped the jobs, and serves the next job once B is gone."""
    with _a_frozen_mid_stream(tiny_model, tiny_model_dir, redis_url, tmp_path, 67) as t:
        assert _taken_by_b(t), t.b.log()  # A stays frozen until B runs every one of its jobs
        t.a.thaw()
        assert t.a.wait_log("dropped: lease lost", timeout=60), t.a.log()
        assert "heartbeat" in t.a.log() and "late" in t.a.log()
        results, (ok, lost, dup) = _results(tiny_model, t)
        assert (ok, lost, dup) == (len(t.jobs), 0, 0)  # nothing A wrote late reached a stream
        assert all(res.stats.worker == t.b_id for res in results if res.id in {j.id for j in t.victims})
        t.b.kill9()
        [(prompt, _, _)] = _specs(68, 1, 20)
        res = t.client.submit(prompt_tokens=prompt, max_tokens=20, ignore_eos=True).result(timeout=120)
        assert res.stats.worker == t.a_id and res.token_ids == reference_tokens(tiny_model, prompt, 20, True)
        assert t.a.proc.poll() is None, t.a.log()


def test_a_worker_whose_engine_is_stuck_stops_renewing_and_exits_and_its_jobs_move(tiny_model, tiny_model_dir,
                                                                                  redis_url, tmp_path):
    """A's engine freezes in its 12th step (kit/frozen_worker.py) with three jobs in it. Its
    leases would be renewed for ever by the control thread; the watchdog (stall_s 2) stops that: A logs
    why, withdraws its heartbeat, exits with 70, and B finishes A's jobs, every stream exact."""
    specs = [(p, 200, True) for p, _, _ in _specs(69, 6, 200)]
    refs = [reference_tokens(tiny_model, p, n, ignore_eos=ie) for p, n, ie in specs]
    client = Client(redis_url, model="tiny", settings=fast_settings(redis_url, **LEASE))
    r = client.redis
    a = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=3, stall_s=2, **LEASE, freeze_at_step=12)
    b = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=3, **LEASE)
    try:
        assert wait_registered(redis_url, n=2), a.log() + b.log()
        a_id, b_id = _worker_id(r, a), _worker_id(r, b)
        jobs, collectors = submit_and_follow(client, specs)
        assert a.wait_log("step 12 never returns"), a.log()
        victims = _held_by(r, jobs, a_id)
        assert victims, a.log()
        assert a.wait(timeout=60) == 70, a.log()
        assert "is stuck: no engine step completed" in a.log()
        results = [j.result(timeout=120) for j in jobs]
        for c in collectors:
            c.join(timeout=30)
        ok, lost, dup = _check_results(tiny_model, results, refs, collectors)
        assert (ok, lost, dup) == (len(jobs), 0, 0)
        by_id = {res.id: res for res in results}
        assert all(by_id[j.id].stats.worker == b_id and by_id[j.id].stats.attempts == 2 for j in victims)
    finally:
        a.stop()
        b.stop()


def test_the_watchdog_times_a_stall_from_the_last_step_and_only_while_jobs_run():
    from mlxq.worker.watchdog import Watchdog

    now = [0.0]
    w = Watchdog(10.0, clock=lambda: now[0])
    now[0] = 100.0
    assert w.check() and w.healthy  # idle for long: no stall
    w.step_started()
    now[0] = 105.0
    w.step_done()
    w.step_started()
    now[0] = 115.0
    assert w.check()  # 10 s since the last step completed: not yet past stall_s
    now[0] = 115.5
    assert not w.check() and not w.healthy
    assert w.reason.startswith("no engine step completed in 10.5s while jobs were running")
    w.step_done()
    assert not w.check()  # unhealthy for good: the worker is exiting
