"""The host thread of a worker (mlxq.worker.hostwork): order, back-pressure, errors, inline mode."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from mlxq import Client
from mlxq.worker.hostwork import HostWork
from workerkit import fast_settings, running_worker


def test_runs_in_order_off_the_caller_thread():
    host = HostWork()
    seen, threads = [], set()

    def note(i):
        seen.append(i)
        threads.add(threading.get_ident())

    for i in range(200):
        host.put(lambda i=i: note(i))
    host.drain()
    host.close()
    assert seen == list(range(200))
    assert threads and threading.get_ident() not in threads


def test_the_caller_waits_when_depth_steps_are_pending():
    host = HostWork(depth=2)
    gate, started = threading.Event(), threading.Event()
    host.put(lambda: (started.set(), gate.wait(30)))
    assert started.wait(30)
    host.put(lambda: None)
    host.put(lambda: None)  # the queue holds two: the next put must wait
    blocked = threading.Thread(target=host.put, args=(lambda: None,))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive()
    gate.set()
    blocked.join(30)
    assert not blocked.is_alive()
    host.drain()
    host.close()


def test_an_error_reaches_the_caller_and_work_goes_on_after_it():
    host = HostWork()
    ran = []
    host.put(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        host.drain()
    host.put(lambda: ran.append(1))  # after the error was raised, work goes on
    host.drain()
    host.close()
    assert ran == [1]


def test_inline_runs_at_once_on_the_caller_thread():
    host = HostWork(inline=True)
    where = []
    host.put(lambda: where.append(threading.get_ident()))
    assert where == [threading.get_ident()]
    host.drain()
    host.close()


def _run_jobs(tiny_model, redis_url, host_thread: bool, cases):
    settings = fast_settings(redis_url, host_thread=host_thread)
    client = Client(redis_url, model="tiny", settings=settings)
    with running_worker(tiny_model, redis_url, settings, max_batch=8):
        jobs = [client.submit(prompt_tokens=p, max_tokens=16, ignore_eos=True, stop=stop, logprobs=2)
                for p, stop in cases]
        out = []
        for job in jobs:
            streamed = list(job.stream(timeout=120))
            res = job.result(timeout=120)
            assert "".join(d.text for d in streamed) == res.text
            assert [t for d in streamed for t in d.token_ids] == res.token_ids
            assert len(res.logprobs) == len(res.token_ids)
            out.append((res.text, res.token_ids, res.finish_reason, [lp["token"] for lp in res.logprobs]))
    client.close()
    return out


def test_the_host_thread_changes_no_output(tiny_model, redis_url):
    """Stop strings (the engine is told a step late), log-probabilities and streams: the same with the
    host thread as inline, and a stop string ends the text where it starts."""
    prompts = [[4 + i, 30 + 7 * i, 9, 60 + i] for i in range(6)]
    plain = _run_jobs(tiny_model, redis_url, False, [(p, None) for p in prompts])
    cases = []
    for prompt, (text, *_) in zip(prompts, plain):  # stop strings cut from this run's own texts
        cut = text[len(text) // 2:len(text) // 2 + 2]
        cases.append((prompt, [cut] if cut.strip() and "\ufffd" not in cut else None))
    inline = _run_jobs(tiny_model, redis_url, False, cases)
    threaded = _run_jobs(tiny_model, redis_url, True, cases)
    assert threaded == inline
    for (prompt, stop), (text, _, finish, _) in zip(cases, threaded):
        if stop:
            assert finish == "stop" and stop[0] not in text


class NoEngine:
    """Enough of an engine for a Worker whose serving loop never runs."""

    def __init__(self):
        self.removed = []

    def add(self, specs):
        assert specs == []  # the tests' jobs have nothing left to generate

    def remove(self, uids):
        self.removed += uids

    def free_slots(self):
        return 4

    def urgent_below(self):
        return float("inf")


def _idle_worker(tiny_model, redis_url):
    import redis

    from mlxq.worker.runner import Worker

    return Worker(redis.Redis.from_url(redis_url), tiny_model, fast_settings(redis_url), engine=NoEngine())


def _job(owner="w:1", **kw):
    return SimpleNamespace(id="a" * 32, uid="a" * 32, owner=owner, suspect="", attempt=2, tokens=[5, 6],
                           request=SimpleNamespace(max_tokens=2), **kw)


def test_a_lost_lease_ends_only_the_attempt_that_lost_it(tiny_model, redis_url):
    """Renew reports a lease lost; before the worker acts on it, another worker's reaper requeued the
    job and this worker pulled it again (a newer owner token): that attempt goes on. Before, the
    worker matched the report by job id and dropped the new attempt too, whose lease then lapsed."""
    worker = _idle_worker(tiny_model, redis_url)
    worker.loop.hostwork.put = lambda fn: fn()
    again, ready = _job(owner="w:2"), _job(owner="w:2")
    worker.active[again.uid] = again
    worker.ready.items.append(ready)
    worker.inbox.lost([(again.id, "w:1")])
    worker.loop.handle_control()
    assert worker.active == {again.uid: again} and list(worker.ready.items) == [ready]
    assert worker.engine.removed == []
    worker.inbox.lost([(again.id, "w:2")])
    worker.loop.handle_control()
    assert worker.active == {} and list(worker.ready.items) == [] and worker.engine.removed == [again.uid] * 2
    worker.loop.hostwork.close()


def test_admit_hands_work_to_the_host_only_after_letting_go_of_the_ready_lock(tiny_model, redis_url):
    """The host thread puts preempted samples of a job with n > 1 back through ``ready.put``, and a
    full host queue makes ``put`` wait for that thread: ``admit`` handing it a resumed job that
    needs no generation (every token published by an earlier attempt) while it held the ready lock
    deadlocked the two threads."""
    worker = _idle_worker(tiny_model, redis_url)
    done = _job()
    free = []

    def put(fn):  # what the host thread does meanwhile: take the ready lock
        other = threading.Thread(target=lambda: free.append(worker.ready.put() or True))
        other.start()
        other.join(30)
        free.append(not other.is_alive())

    worker.loop.hostwork.put = put
    worker.ready.put(done)
    worker.loop.admit()
    assert free == [True, True] and worker.active == {done.uid: done}
    worker.loop.hostwork.close()
