"""Tiers that Redis decides, and the ACL recipe for producer services (mlxq.shared.acl):
a producer user may only FCALL mlxq's functions and read its own jobs.  As that user, a raw
ZADD into the queue, a function call that tries to choose its tier, raw writes to its own job
record and EVAL of new code change nothing; its jobs still run, at its key's tier."""

from __future__ import annotations

import pytest
import redis
from redis.exceptions import NoPermissionError

from mlxq import AuthError, Client
from mlxq.shared import apikeys
from mlxq.shared.acl import producer_rules
from mlxq.shared.connection import connect
from mlxq.shared.keys import GlobalKeys, ModelKeys
from mlxq.shared.protocol import Queue, function_name, load_functions
from workerkit import fast_settings, running_worker, wait_for
from faultkit import record

GK = GlobalKeys()
K = ModelKeys("tiny")
LOW_KEY, HIGH_KEY = "producer-low-key-0001", "someone-elses-high-key"


def _as_user(url: str, user: str, pw: str) -> str:
    return url.replace("redis://", f"redis://{user}:{pw}@", 1)


@pytest.fixture
def acl_setup(redis_url, tiny_model):
    admin = redis.Redis.from_url(redis_url)
    admin.hset(GK.models, "tiny", b"")
    apikeys.add_key(admin, GK, LOW_KEY, "low")
    apikeys.add_key(admin, GK, HIGH_KEY, "high")
    apikeys.set_policy(admin, GK, anonymous="normal")  # the anonymous producers below are let in, at normal
    load_functions(admin)  # what a worker does at start
    apikeys.sync_model(admin, admin, GK, "tiny")
    admin.execute_command("ACL", "SETUSER", "producer", *producer_rules("producer-pw"))
    try:
        yield admin, _as_user(redis_url, "producer", "producer-pw")
    finally:
        admin.execute_command("ACL", "DELUSER", "producer")
        admin.close()


@pytest.fixture
def as_producer(acl_setup, redis_url):
    """(admin client, the producer user's Client with the low key, its raw connection, the admin's Queue)."""
    admin, purl = acl_setup
    settings = fast_settings(redis_url)
    producer = Client(purl, api_key=LOW_KEY, model="tiny", settings=settings)
    raw = connect(purl)
    try:
        yield admin, producer, raw, Queue(admin, K, settings)
    finally:
        producer.close()
        raw.close()


def test_producer_user_cannot_choose_its_priority(acl_setup, redis_url, tiny_model):
    admin, purl = acl_setup
    settings = fast_settings(redis_url)
    raw = connect(purl)
    refused = 0

    # 1. a raw ZADD into the queue (and other priority writes) is refused by the ACL
    for attempt in (lambda: raw.zadd(K.queue, {"f" * 32: 0}), lambda: raw.hincrby(K.counts, "queued:high", -5),
                    lambda: raw.hset(K.key_copy, "x", "high"), lambda: raw.hset(K.policy, "offset:low", 0),
                    lambda: raw.hset(GK.api_keys, apikeys.key_hash("mine-mine-mine"), "high"),
                    lambda: raw.hgetall(GK.api_keys)):
        with pytest.raises(NoPermissionError):
            attempt()
        refused += 1
    # 2. no new code: EVAL, EVALSHA (even of mlxq's own script), SCRIPT LOAD, FUNCTION LOAD
    for attempt in (lambda: raw.eval("return redis.call('ZADD', KEYS[1], 0, 'x')", 1, K.queue),
                    lambda: raw.evalsha("0" * 40, 0), lambda: raw.script_load("return 1"),
                    lambda: raw.function_load("#!lua name=evil\nredis.register_function('e', function() end)")):
        with pytest.raises(NoPermissionError):
            attempt()
        refused += 1
    assert admin.zcard(K.queue) == 0 and admin.llen(K.intake) == 0

    # 3. the trusted enqueue function (it writes the queue) is refused as a whole: under FCALL every
    #    declared key needs write access; the read-only check takes a key hash, never a tier, so "high"
    #    in its place is an unknown key; submit has no tier at all: a forged "high" floor or extra
    #    argument leaves an anonymous job at the anonymous tier (normal) once a worker admits it
    job_id = "a" * 32
    keys = [K.job(job_id), K.counts, K.wake, K.job(job_id), K.intake, K.queue, K.key_copy, K.policy]
    with pytest.raises(NoPermissionError):
        raw.fcall(function_name("enqueue"), len(keys), *keys, job_id, b"req", apikeys.key_hash(LOW_KEY), "", "0", 60)
    refused += 1
    assert not admin.exists(K.job(job_id)) and admin.zcard(K.queue) == 0
    reply = raw.fcall_ro(function_name("check"), 3, K.key_copy, K.policy, K.counts, "high", "")
    assert reply == [b"unauthorized", b"unknown API key"]
    refused += 1
    raw.fcall(function_name("submit"), 4, K.job(job_id), K.job(job_id), K.intake, K.wake, job_id, b"req", "", "high",
              "0", 60, "", "", "", "high", 0)  # (ARGV 7-9: run_at, expires_at, webhook, none here)
    assert Queue(admin, K, settings).admit() == (1, 0)
    assert admin.hget(K.job(job_id), "tier") == b"normal"
    admin.zrem(K.queue, job_id)  # (not a real request: keep it away from the worker below)
    admin.hincrby(K.counts, "queued:normal", -1)
    refused += 1

    # 4. the producer's own client: EVALSHA is refused, so it switches to the functions and the intake list
    producer = Client(purl, api_key=LOW_KEY, model="tiny", settings=settings)
    job = producer.submit(prompt_tokens=[5, 6, 7], max_tokens=2, ignore_eos=True)  # "length" by construction
    assert producer.queue_for("tiny").functions and admin.lrange(K.intake, 0, -1) == [job.id.encode()]
    # raw writes to its own record before admission: admission decides again, from the key hash
    raw.hset(K.job(job.id), mapping={"tier": "high", "score": 0, "queued_at": 0})
    floor = producer.submit(prompt_tokens=[5, 6, 8], max_tokens=2, _floor="high")  # a floor only lowers
    q = Queue(admin, K, settings)
    assert q.admit() == (2, 0)
    for j in (job, floor):
        assert admin.hget(K.job(j.id), "tier") == b"low"
    now = float(admin.time()[0])
    assert admin.zscore(K.queue, job.id) > now + 250  # low's offset (300 s), not the forged 0
    refused += 1

    # 5. the jobs run, results and streams read back as that user
    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        res = job.result(timeout=60)
        text = "".join(d.text for d in floor.stream(timeout=60))
        assert res.finish_reason == "length" and res.stats.tier == "low"
        assert text == floor.result(timeout=60).text
        # cancel as the producer: a queued-and-admitted job is flagged, a worker takes it out
        blocker = producer.submit(prompt_tokens=[9, 9], max_tokens=1)
        assert blocker.result(timeout=60).finish_reason in ("length", "stop")

        # 6. revoking the key takes effect at once: the admin writes every model's copy
        apikeys.revoke_key(admin, GK, LOW_KEY)
        with pytest.raises(AuthError):
            producer.submit(prompt_tokens=[5], max_tokens=1)
        refused += 1
    counts = q.counts()
    record("ACL producer user", 3, 3, 0, 0, refused_attempts=refused, admitted=counts.get("submitted"))
    producer.close()
    raw.close()


def test_revocation_between_enqueue_and_admission_refuses_the_job(acl_setup, redis_url):
    admin, purl = acl_setup
    settings = fast_settings(redis_url)
    producer = Client(purl, api_key=LOW_KEY, model="tiny", settings=settings)
    job = producer.submit(prompt_tokens=[5, 6], max_tokens=2)
    apikeys.revoke_key(admin, GK, LOW_KEY)
    assert Queue(admin, K, settings).admit() == (0, 1)
    res = job.result(timeout=10)
    assert res.finish_reason == "error" and "revoked" in res.error
    assert admin.zcard(K.queue) == 0
    producer.close()


def test_a_producer_cannot_drop_other_producers_jobs_from_the_intake_list(acl_setup, redis_url):
    """The recipe's write access to the intake list is for pushing: LTRIM, EXPIRE and SET need no more
    than write access, and with them any producer could drop every job other producers had submitted
    and no worker had admitted yet (their records stayed queued, their callers waited for ever). EXPIRE
    is granted on job keys only (a cancel request ends a job's record), SET on idempotency keys only,
    and BLPOP on done lists only: submit declares the intake list, so the recipe grants reading it,
    and BLPOP would have popped (and shown) other producers' job ids. HSET and XADD, which the
    producer has for its job keys, may not touch the lists either. A cancel request still works."""
    admin, purl = acl_setup
    settings = fast_settings(redis_url)
    other = Client(redis_url.replace("redis://", "redis://producer:producer-pw@", 1), api_key=LOW_KEY,
                   model="tiny", settings=settings)
    waiting = other.submit(prompt_tokens=[5, 6, 7], max_tokens=2)
    raw = connect(purl)
    for attempt in (lambda: raw.ltrim(K.intake, 1, 0), lambda: raw.expire(K.intake, 1),
                    lambda: raw.expire(K.wake, 1), lambda: raw.expire(K.counts, 1),
                    lambda: raw.set(K.intake, "x"), lambda: raw.set(K.wake, "x"),
                    lambda: raw.blpop([K.intake], timeout=1), lambda: raw.blpop([K.wake], timeout=1),
                    # a hash or a stream where an empty list was: every submit failed with WRONGTYPE
                    lambda: raw.hset(K.intake, "x", "1"), lambda: raw.hset(K.wake, "x", "1"),
                    lambda: raw.xadd(K.intake, {"x": "1"}), lambda: raw.xadd(K.wake, {"x": "1"})):
        with pytest.raises(NoPermissionError):
            attempt()
    assert admin.lrange(K.intake, 0, -1) == [waiting.id.encode()] and admin.ttl(K.intake) == -1
    admin.rpush(K.done(waiting.id), "1")
    assert raw.blpop([K.done(waiting.id)], timeout=1)  # its own job's done list: allowed
    assert raw.expire(K.job(waiting.id), 3600)  # its own job's keys: allowed
    assert waiting.cancel() == "cancelled" and waiting.result(timeout=10).finish_reason == "cancelled"
    other.close()
    raw.close()


def test_what_a_producer_writes_into_its_admitted_job_decides_nothing(as_producer):
    """A producer under the recipe may write its own job hash. Once a worker admitted the job, its
    tier, score and suspect flag live in a worker-only hash (sched): a requeue and the reaper put it
    back at the score the worker gave it (they read the hash's, so a forged score of 0, and a lease
    ended by deleting its owner field, put a low job at the head of the queue); pushing it on the
    intake list again admits nothing (each push counted it again, until the tier read as full); a
    forged error makes no suspect (a suspect drains the worker's engine and runs alone)."""
    admin, producer, raw, q = as_producer
    job = producer.submit(prompt_tokens=[5, 6, 7], max_tokens=2)
    assert q.admit() == (1, 0)
    score = admin.zscore(K.queue, job.id)
    counts = q.counts()
    forged = {"tier": "high", "score": "-1000000000", "error": "forged", "admitted": ""}
    # pushed again while queued: not admitted twice, not counted twice
    raw.hdel(K.job(job.id), "admitted")
    raw.rpush(K.intake, job.id)
    assert q.admit() == (0, 0) and q.counts()["queued:low"] == counts["queued:low"]
    [p] = q.pull(1, "w")
    assert p.score == pytest.approx(score, abs=1e-5) and p.tier == "low"
    raw.hset(K.job(job.id), mapping=forged)
    assert q.requeue(job.id, f"w:{p.attempt}") == 1  # a preemption
    assert admin.zscore(K.queue, job.id) == pytest.approx(score, abs=1e-5)
    assert q.counts()["queued:low"] == counts["queued:low"]
    [p] = q.pull(1, "w")
    assert p.suspect == "" and p.tier == "low" and p.score == pytest.approx(score, abs=1e-5)
    raw.hset(K.job(job.id), mapping=forged)
    raw.hdel(K.job(job.id), "owner")  # ends the lease: the reaper requeues it
    admin.zadd(K.inflight, {job.id: 0}, xx=True)  # (its lease expired)
    assert q.reap() == (1, 0, 0, 0)
    assert admin.zscore(K.queue, job.id) == pytest.approx(score, abs=1e-5)
    assert q.counts()["queued:low"] == counts["queued:low"]
    tier, kept, suspect = admin.hget(K.sched, job.id).split()
    assert tier == b"low" and float(kept) == pytest.approx(score, abs=1e-5) and suspect == b"0"
    assert job.cancel() == "cancelling" and q.cancel(job.id, mode="worker") == "cancelled"  # as a worker acts
    assert not admin.hexists(K.sched, job.id)  # the entry ends with the job


def test_an_admitted_job_whose_record_vanished_leaves_no_count_behind(as_producer):
    """A producer may expire its own job's record (EXPIRE 0 deletes it). Queued, the job is then
    garbage to pull, and its queued count goes with it; running, the reaper drops it and its running
    count goes with it. Both counts stayed, one more each time (a tier read as fuller than it was)."""
    admin, producer, raw, q = as_producer
    before = q.counts()
    a, b = (producer.submit(prompt_tokens=[5, 6, i], max_tokens=2) for i in (7, 8))
    assert q.admit() == (2, 0)
    [p] = q.pull(1, "w")
    assert p.job_id == a.id  # a runs, b waits
    raw.expire(K.job(a.id), 0)
    raw.expire(K.job(b.id), 0)
    assert [x.kind for x in q.pull(1, "w")] == ["garbage"]  # b
    admin.zadd(K.inflight, {a.id: 0}, xx=True)  # (a's lease expired)
    q.reap()
    after = q.counts()
    for name in ("queued:low", "running"):
        assert after.get(name, 0) == before.get(name, 0), name
    assert not admin.hexists(K.sched, a.id) and not admin.hexists(K.sched, b.id)


def test_a_producer_that_skips_check_meets_the_bound_at_admission(acl_setup, redis_url):
    """check refuses a submission when the tier's queue is full; a producer under the recipe may call
    submit without it, and admission placed every such job (the tier's queue grew without bound).
    Admission now refuses past twice the bound (room for producers that passed check before the
    admissions), failing the job with an error that says so."""
    from mlxq.shared.protocol import function_name

    admin, purl = acl_setup
    settings = fast_settings(redis_url)
    q = Queue(admin, K, settings)
    raw = connect(purl)
    before = q.counts().get("queued:normal", 0)
    bound = before + 2
    apikeys.set_policy(admin, GK, max_queued=bound)
    jobs = [f"{i:032x}" for i in range(0xb0, 0xb0 + 2 * bound - before + 1)]
    try:
        for job_id in jobs:  # anonymous: the normal tier
            raw.fcall(function_name("submit"), 4, K.job(job_id), K.job(job_id), K.intake, K.wake, job_id, b"req",
                      "", "", "0", 60)
        assert q.admit() == (len(jobs) - 1, 1)
        assert q.counts()["queued:normal"] == 2 * bound
        err = admin.hget(K.job(jobs[-1]), "error").decode()
        assert admin.hget(K.job(jobs[-1]), "status") == b"failed" and "queue is full" in err
    finally:
        admin.zrem(K.queue, *jobs)  # (not real requests: keep them from any worker)
        admin.hincrby(K.counts, "queued:normal", -(len(jobs) - 1))
        for job_id in jobs:
            admin.hdel(K.sched, job_id)
        apikeys.set_policy(admin, GK, max_queued=settings.max_queued_per_tier)
        raw.close()


def test_worker_copies_the_registry_into_a_new_models_slot(redis_url, tiny_model):
    """A model no admin command has seen: its worker copies registry and policy at start, and a
    change made by the admin afterwards reaches the copy (within a stats tick)."""
    admin = redis.Redis.from_url(redis_url)
    apikeys.add_key(admin, GK, LOW_KEY, "low")
    settings = fast_settings(redis_url)
    with running_worker(tiny_model, redis_url, settings):
        assert wait_for(lambda: admin.hget(K.policy, "version") is not None, timeout=20)
        assert admin.hget(K.key_copy, apikeys.copy_field(apikeys.key_hash(LOW_KEY))) == b"low"
        apikeys.set_policy(admin, GK, offsets={"low": 120.0})
        assert admin.hget(K.policy, "offset:low") == b"120.0"
        # a copy that fell behind (e.g. written while the model was unknown) is repaired by the worker
        admin.hset(K.policy, "version", "stale")
        assert wait_for(lambda: admin.hget(K.policy, "version") == admin.get(GK.policy_version), timeout=20)
    admin.close()


def test_a_stale_idempotency_key_is_no_duplicate_for_a_producer_under_the_recipe(as_producer):
    """submit answered ``duplicate`` for an idempotency key whose job's record was gone (expired, or
    deleted): a job nobody could read. Such a key now counts as absent: the new job is submitted."""
    admin, producer, raw, q = as_producer
    first = producer.submit(prompt_tokens=[5, 6, 7], max_tokens=2, idempotency_key="retry-me")
    assert producer.submit(prompt_tokens=[5, 6, 7], max_tokens=2, idempotency_key="retry-me").id == first.id
    admin.lrem(K.intake, 0, first.id)
    admin.delete(K.job(first.id))  # (expired)
    again = producer.submit(prompt_tokens=[5, 6, 7], max_tokens=2, idempotency_key="retry-me")
    assert not again.duplicate and again.id != first.id
    assert admin.lrange(K.intake, 0, -1) == [again.id.encode()]
