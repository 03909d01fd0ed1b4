"""Jobs with a life of their own (docs/pipelines/job-life.md) against a real Valkey: an expiry already
past is refused at submit; a job not started by its expires_at ends ``expired`` and never runs, whether
the reaper's sweep or a pull finds it; a deferred job is not pulled before its run_at and is after it,
through a worker killed (-9) while it waits. Assertions read statuses and events, never durations."""

from __future__ import annotations

import json
import time

import pytest
import redis

from mlxq import Client
from mlxq.cli import main
from mlxq.producer.core import life_times
from mlxq.producer.records import record_fields
from mlxq.producer.webhooks import summary
from mlxq.shared import codec
from mlxq.shared.keys import ModelKeys
from mlxq.shared.protocol import JobRefused, Queue
from faultkit import WorkerProc, wait_registered
from workerkit import fast_settings, running_worker, wait_for


def server_now(r) -> float:
    sec, usec = r.time()
    return sec + usec / 1e6


@pytest.fixture
def env(redis_url):
    r = redis.Redis.from_url(redis_url)
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    q = Queue(r, ModelKeys("tiny"), settings)
    yield r, client, q
    client.close()
    r.close()


def test_times_that_could_never_run_are_refused_at_submit(env, capsys):
    r, client, q = env
    with pytest.raises(ValueError, match="already past"):
        client.submit("hi", max_tokens=2, expires_at=time.time() - 1)
    with pytest.raises(ValueError, match="must be after run_at"):
        client.submit("hi", max_tokens=2, defer_s=60, expires_in=30)
    with pytest.raises(ValueError, match="not both"):
        client.submit("hi", max_tokens=2, defer_s=1, run_at=time.time() + 1)
    with pytest.raises(ValueError, match="defer_s must be"):
        life_times({"defer_s": "soon"}, time.time())
    # a producer that skips the check (another language's): the enqueue script refuses on the server's clock
    past = server_now(r) - 5
    req = codec.pack({"id": "a" * 32, "model": "tiny", "prompt": "hi", "expires_at": past})
    with pytest.raises(JobRefused, match="expires_at is already past"):
        q.enqueue("a" * 32, req, global_redis=r)
    assert not r.exists(q.keys.job("a" * 32)) and r.zcard(q.keys.queue) == 0
    # mlxq submit's flags: the same refusal, before anything is queued
    assert main(["submit", "hi", "--expires-in", "-1", "--queue", "tiny", "--redis-url", client.settings.redis_url]) == 2
    assert "expires_in must be a number of seconds" in capsys.readouterr().err
    assert r.zcard(q.keys.queue) == r.zcard(q.keys.deferred) == 0


def test_a_job_not_started_by_its_expiry_ends_expired_and_never_runs(env):
    r, client, q = env
    # no worker: the reaper's sweep (run here as the control thread runs it) ends it, and its caller hears
    swept = client.submit("hi", max_tokens=2, expires_in=0.2)
    assert wait_for(lambda: q.reap() is not None and r.hget(q.keys.job(swept.id), "status") == b"expired",
                    timeout=30)
    res = swept.result(timeout=30)
    assert res.finish_reason == "error" and res.error.startswith("expired:")
    assert swept.status() == "expired"
    # one past its time that a worker's pull reaches first: it ends there, and the pull leases nothing
    pulled_late = client.submit("hi", max_tokens=2, expires_in=0.2)
    expires_at = float(r.hget(q.keys.job(pulled_late.id), "expires_at"))
    assert wait_for(lambda: server_now(r) > expires_at, timeout=30)
    assert q.pull(4, "w-test") == []
    rec = {k.decode(): v for k, v in r.hgetall(q.keys.job(pulled_late.id)).items()}
    assert rec["status"] == b"expired" and rec["attempts"] == b"0" and "started_at" not in rec
    assert pulled_late.result(timeout=30).error.startswith("expired:")
    counts = q.counts()
    assert counts["expired"] == 2 and counts.get("queued:normal", 0) == 0 and counts.get("running", 0) == 0
    # a job with an expiry that starts in time runs as any other (tests below run them with a worker)


def test_a_deferred_job_is_not_pulled_before_its_time_and_is_after_it(env, capsys):
    r, client, q = env
    job = client.submit("hi", max_tokens=3, defer_s=0.5)
    run_at = float(r.hget(q.keys.job(job.id), "run_at"))
    assert r.zscore(q.keys.deferred, job.id) == pytest.approx(run_at) and r.zcard(q.keys.queue) == 0
    assert main(["jobs", "list", "--queue", "tiny", "--status", "deferred", "--json", "--redis-url",
                 client.settings.redis_url]) == 0
    assert [row["id"] for row in json.loads(capsys.readouterr().out)] == [job.id]
    pulled = q.pull(4, "w-test")
    if server_now(r) < run_at:  # (the pull checks the server's clock: only one that ended before run_at says so)
        assert pulled == [] and r.hget(q.keys.job(job.id), "status") == b"queued"
    assert wait_for(lambda: server_now(r) > run_at, timeout=30)
    pulled = pulled or q.pull(4, "w-test")
    assert [(p.job_id, p.kind, p.attempt) for p in pulled] == [(job.id, "job", 1)]
    assert float(r.hget(q.keys.job(job.id), "started_at")) >= run_at and r.zcard(q.keys.deferred) == 0


def test_a_deferred_job_waits_in_redis_through_a_worker_killed_while_it_waits(env, tiny_model, tiny_model_dir,
                                                                               redis_url, tmp_path):
    r, client, q = env
    worker = WorkerProc(redis_url, tiny_model_dir, tmp_path)
    try:
        assert wait_registered(redis_url)
        job = client.submit("hi", max_tokens=3, ignore_eos=True, defer_s=600, expires_in=3600)
        worker.kill9()  # while the job waits (for ten minutes: it is still waiting below)
    finally:
        worker.stop()
    assert r.hget(q.keys.job(job.id), "attempts") == b"0" and r.zscore(q.keys.deferred, job.id)
    # its time comes (moved to now in Redis, rather than waited for) with no process alive that knew of it
    r.zadd(q.keys.deferred, {job.id: server_now(r)}, xx=True)
    with running_worker(tiny_model, redis_url, fast_settings(redis_url)):
        res = job.result(timeout=60)
    assert res.finish_reason == "length" and len(res.token_ids) == 3
    assert res.stats.attempts == 1 and r.hget(q.keys.job(job.id), "status") == b"done"
    assert r.zcard(q.keys.deferred) == 0 and r.zcard(q.keys.queue) == 0
    # what a webhook would say of it (the summary of a finished record, read as clients read it)
    msg = summary("tiny", job.id, record_fields(r.hgetall(q.keys.job(job.id))))
    assert msg["type"] == "job.done" and msg["data"]["finish_reason"] == "length"
    assert msg["data"]["usage"] == {"prompt_tokens": res.stats.prompt_tokens, "completion_tokens": 3}


def test_a_restricted_producers_job_keeps_its_life_through_admission(env):
    """A producer under the ACL recipe submits to the intake list (submit.lua, the record holds the fields);
    the worker's admission defers, indexes the expiry and the webhook, as the enqueue script does."""
    r, client, q = env
    client.submit("warm", max_tokens=1).cancel()  # (the slot's policy copy, as any first submit makes it)
    now = server_now(r)
    ids = {"deferred": "b" * 32, "expiring": "c" * 32}
    for name, life in (("deferred", {"run_at": now + 300}), ("expiring", {"expires_at": now + 0.2})):
        job_id = ids[name]
        req = codec.pack({"id": job_id, "model": "tiny", "prompt": "hi", **life})
        assert q.run(q.calls.submit(job_id, req, None, None, None))[0] == b"ok"
    past = codec.pack({"id": "d" * 32, "model": "tiny", "prompt": "hi", "expires_at": now - 1})
    assert q.run(q.calls.submit("d" * 32, past, None, None, None))[:3] == [b"invalid_time", b"d" * 32,
                                                                           b"expires_at is already past"]
    assert q.admit() == (2, 0)
    assert r.zscore(q.keys.deferred, ids["deferred"]) == pytest.approx(now + 300)
    assert r.zscore(q.keys.queue, ids["deferred"]) is None and r.zscore(q.keys.queue, ids["expiring"])
    assert r.zscore(q.keys.expiring, ids["expiring"]) == pytest.approx(now + 0.2)
    assert wait_for(lambda: server_now(r) > now + 0.2, timeout=30)
    q.reap()  # the sweep
    assert r.hget(q.keys.job(ids["expiring"]), "status") == b"expired" and r.zcard(q.keys.queue) == 0
    assert q.cancel(ids["deferred"]) == "cancelled" and q.pull(4, "w-test") == []


def test_life_arguments_without_their_keys_are_refused(env):
    """An enqueue call with run_at/expires_at/webhook (ARGV 7-9) but the old eight keys writes nothing."""
    r, client, q = env
    client.submit("warm", max_tokens=1).cancel()  # (the slot's policy copy)
    req = codec.pack({"id": "e" * 32, "model": "tiny", "prompt": "hi", "run_at": server_now(r) + 60})
    name, keys, args = q.calls.enqueue("e" * 32, req, None, None, None)
    reply = q.run((name, keys[:8], args))
    assert reply[0] == b"invalid_time" and b"keys 9-11" in reply[2] and not r.exists(q.keys.job("e" * 32))
