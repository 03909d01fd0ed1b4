"""The Lua scripts on a real Valkey (fakeredis lacks redis.sha1hex, which tier decisions use): atomic enqueue/pull/complete/cancel, priority and aging, leases."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import redis

from mlxq.shared import apikeys
from mlxq.shared.keys import GlobalKeys, ModelKeys
from mlxq.shared.protocol import OverloadError, Queue, owner_token
from mlxq.shared.settings import Settings
from workerkit import publish_deltas

GK = GlobalKeys()


@pytest.fixture
def rr(redis_url):
    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()
TIER_KEYS = {t: f"key-of-tier-{t}" for t in ("high", "normal", "low")}


def make_queue(r, **kw) -> Queue:
    """A queue for model 'm' with one API key per tier; offsets and the bound stored in Redis."""
    settings = Settings(**kw)
    r.hset(GK.models, "m", b"")
    for tier, key in TIER_KEYS.items():
        apikeys.add_key(r, GK, key, tier)
    apikeys.set_policy(r, GK, settings.tier_offsets, settings.max_queued_per_tier)
    return Queue(r, ModelKeys("m"), settings)


def enq(q: Queue, job_id: str, tier: str, idem=None):
    """Enqueue as the holder of a key of ``tier`` (the tier itself is decided by the script)."""
    return q.enqueue(job_id, b"x", apikeys.key_hash(TIER_KEYS[tier]), None, idem)


def ids(n):
    return [f"{i:032x}" for i in range(1, n + 1)]


def test_pull_order_is_tier_then_age(rr):
    q = make_queue(rr)
    a, b, c = ids(3)
    enq(q, a, "low")
    enq(q, b, "normal")
    enq(q, c, "high")
    assert [p.job_id for p in q.pull(3, "w")] == [c, b, a]


def test_aging_old_low_beats_new_high(rr):
    q = make_queue(rr, tier_offsets={"high": 0.0, "normal": 0.05, "low": 0.1})
    a, b = ids(2)
    enq(q, a, "low")
    time.sleep(0.15)  # older than the tier gap: it must not starve
    enq(q, b, "high")
    assert [p.job_id for p in q.pull(2, "w")] == [a, b]


def test_counts_are_exact_through_a_lifecycle(rr):
    q = make_queue(rr)
    a, b, c = ids(3)
    for j in (a, b, c):
        enq(q, j, "normal")
    assert q.counts()["queued:normal"] == 3
    assert q.cancel(c) == "cancelled"
    pulled = q.pull(5, "w")
    assert {p.job_id for p in pulled} == {a, b}
    c_ = q.counts()
    assert (c_["queued:normal"], c_["running"], c_["cancelled"]) == (0, 2, 1)
    assert q.complete(a, "w:1", "done", b"r") == 1
    assert q.complete(b, "w:1", "failed", b"r") == 1
    c_ = q.counts()
    assert (c_["running"], c_["done"], c_["failed"], c_["processed"], c_["submitted"]) == (0, 1, 1, 3, 3)


def test_completion_is_fenced_on_the_lease_owner(rr):
    q = make_queue(rr)
    [a] = ids(1)
    enq(q, a, "normal")
    [p] = q.pull(1, "w1")
    assert p.attempt == 1
    assert q.complete(a, "w2:1", "done", b"r") == 0  # not the owner
    assert q.complete(a, "w1:1", "done", b"r") == 1
    assert q.complete(a, "w1:1", "done", b"r") == 0  # already finished: single result


def test_deltas_are_fenced_on_the_lease_owner(rr):
    """A worker that lost a job's lease (another attempt owns it) appends and publishes nothing."""
    q = make_queue(rr)
    a, b = ids(2)
    enq(q, a, "normal")
    enq(q, b, "normal")
    q.pull(2, "w1")
    refused = publish_deltas(q, [(a, "w1:1", b"d1", 1), (b, "zombie:1", b"d2", 2), (b, "zombie:1", b"d3", 3),
                                (a, "w1:1", b"d4", 4)])
    assert [k.decode() for k in refused] == [q.keys.job(b)]
    assert [f[b"d"] for _, f in rr.xrange(q.keys.events(a))] == [b"d1", b"d4"]
    assert rr.xlen(q.keys.events(b)) == 0
    assert rr.ttl(q.keys.events(a)) == -1  # no TTL while the job runs (every end of the job sets it)


def test_cancel_running_flags_and_notifies(rr):
    q = make_queue(rr)
    [a] = ids(1)
    enq(q, a, "normal")
    q.pull(1, "w")
    assert q.cancel(a) == "cancelling"
    lost, cancel = q.renew({a: "w:1"})
    assert lost == [] and cancel == [a]
    assert q.cancel("f" * 32) == "unknown"


def test_idempotency_key_returns_the_same_job(rr):
    q = make_queue(rr)
    a, b = ids(2)
    first = enq(q, a, "low", "key-1")
    second = enq(q, b, "low", "key-1")
    assert first.status == "ok" and second.status == "duplicate" and second.job_id == a
    assert q.counts()["queued:low"] == 1


def test_idempotency_keys_are_scoped_to_the_api_key(rr):
    """Two producers (API keys) that pick the same idempotency key get two jobs, and neither learns the
    other's job id (a duplicate reply named it: its prompt, result and stream were the other's to
    read). A key named for another caller's scope is refused: no call can find, or squat, another
    producer's entry."""
    from mlxq.shared.protocol import JobRefused

    q = make_queue(rr)
    a, b, c, d = ids(4)
    first = enq(q, a, "low", "order-1001")
    other = enq(q, b, "high", "order-1001")
    again = enq(q, c, "low", "order-1001")
    assert first.status == other.status == "ok" and other.job_id == b
    assert again.status == "duplicate" and again.job_id == a
    mine = apikeys.key_hash(TIER_KEYS["high"])
    # (the deferred, expiring and webhooks keys, then the fair-share keys)
    job, counts, wake, _, intake, queue, key_copy, policy, *rest = q.calls.enqueue(
        d, b"x", mine, None, "order-1001")[1]
    theirs = q.keys.idempotency("order-1001", apikeys.key_hash(TIER_KEYS["low"]))
    script = q._scripts["enqueue"]
    reply = script(keys=[job, counts, wake, theirs, intake, queue, key_copy, policy, *rest],
                   args=[d, b"x", mine, "", "1", 60])
    assert reply[0] == b"invalid_idempotency_key" and not rr.exists(q.keys.job(d))
    with pytest.raises(JobRefused, match="scoped"):
        from mlxq.shared.protocol import parse_enqueue
        parse_enqueue(reply)


def test_overload_refuses_past_the_bound(rr):
    q = make_queue(rr, max_queued_per_tier=2)
    a, b, c, d = ids(4)
    enq(q, a, "low")
    enq(q, b, "low")
    with pytest.raises(OverloadError):
        enq(q, c, "low")
    enq(q, d, "high")  # the bound is per tier
    # a retry of b after a lost reply, at the bound: b is queued, so the answer is ok, not overload
    # (a client told overload would give up on a job that runs all the same)
    again = enq(q, b, "low")
    assert again.status == "ok" and again.job_id == b and q.counts()["queued:low"] == 2


def test_expired_lease_is_requeued_then_dead_lettered(rr):
    q = make_queue(rr, lease_s=0.05, heartbeat_s=0.01, max_attempts=2)
    [a] = ids(1)
    first = enq(q, a, "normal")
    q.pull(1, "w1")
    time.sleep(0.1)
    assert q.reap() == (1, 0, 0, 0)
    [p] = q.pull(1, "w2")
    assert p.attempt == 2 and p.score == pytest.approx(first.score)  # original score kept
    assert q.complete(a, "w1:1", "done", b"late") == 0  # the old owner is fenced out
    time.sleep(0.1)
    assert q.reap() == (0, 1, 0, 0)
    h = rr.hgetall(q.keys.job(a))
    assert h[b"status"] == b"dead" and b"lease expired" in h[b"error"]
    assert rr.zscore(q.keys.dead, a) is not None


def test_a_dead_workers_jobs_are_taken_over_before_their_leases_expire(rr):
    """A worker's beat vouches for it for takeover_s; past that, any reaper requeues the jobs it holds
    (their leases would run for a minute yet), fenced: the old owner's late writes are refused, and its
    late beat finds those leases lost. A live worker's jobs are left alone, and so is a job whose
    owner beat after the reaper looked (the script checks the beat again)."""
    q = make_queue(rr, lease_s=60, heartbeat_s=0.02, takeover_s=0.1)
    a, b = ids(2)
    enq(q, a, "normal")
    enq(q, b, "normal")
    q.pull(1, "w1")
    q.pull(1, "w2")
    assert q.heartbeat("w1", {a: "w1:1"}) == ([], [], 0.0)
    assert q.heartbeat("w2", {b: "w2:1"}) == ([], [], 0.0)
    assert q.reap() == (0, 0, 0, 0)
    time.sleep(0.15)
    q.heartbeat("w2", {b: "w2:1"})
    assert q.run(q.calls.reap([b])) == [0, 0, 0, 0]  # handed as a candidate, but w2 beat in time
    assert q.reap() == (1, 0, 0, 1)
    assert rr.hget(q.keys.job(a), "status") == b"queued" and rr.zscore(q.keys.inflight, a) is None
    assert rr.hget(q.keys.job(b), "owner") == b"w2:1"
    assert publish_deltas(q, [(a, "w1:1", b"late", 1)]) == [q.keys.job(a).encode()]  # fenced out
    assert q.complete(a, "w1:1", "done", b"late") == 0
    lost, _, late = q.heartbeat("w1", {a: "w1:1"})
    assert lost == [a] and late > 0  # it was only slow: it drops the job and serves on
    [p] = q.pull(1, "w2")
    assert p.job_id == a and p.attempt == 2  # the attempt counted, as for a lease that expired
    assert q.reap() == (0, 0, 0, 0)


def test_an_overdue_worker_that_holds_nothing_is_forgotten(rr):
    q = make_queue(rr, lease_s=60, heartbeat_s=0.02, takeover_s=0.05)
    q.heartbeat("w1", {})
    q.heartbeat("w2", {})
    assert rr.zcard(q.keys.beats) == 2
    time.sleep(0.1)
    q.heartbeat("w2", {})
    assert q.reap() == (0, 0, 0, 0)
    assert [m for m in rr.zrange(q.keys.beats, 0, -1)] == [b"w2"]


def test_a_job_whose_lease_expired_twice_comes_back_a_suspect(rr):
    """One worker dying (kill -9, a lost node) says nothing about its jobs: they come back as they were.
    A job whose second lease in a row expired comes back a suspect, which the next worker runs alone."""
    q = make_queue(rr, lease_s=0.05, heartbeat_s=0.01, max_attempts=3)
    [a] = ids(1)
    enq(q, a, "normal")
    q.pull(1, "w1")
    time.sleep(0.1)
    assert q.reap() == (1, 0, 0, 0)
    [p] = q.pull(1, "w2")
    assert p.attempt == 2 and p.suspect == ""
    time.sleep(0.1)
    assert q.reap() == (1, 0, 0, 0)
    [p] = q.pull(1, "w3")
    assert p.attempt == 3 and p.suspect == "a worker died or hung while it held the job (attempt 2)"
    time.sleep(0.1)
    assert q.reap() == (0, 1, 0, 0)
    err = rr.hget(q.keys.job(a), "error")
    assert err == (b"lease expired after 3 attempts (worker died or hung); "
                   b"last error: a worker died or hung while it held the job (attempt 2)")


def test_requeue_with_an_error_counts_the_attempt_and_ends_the_lease_for_the_reaper(rr):
    q = make_queue(rr, max_attempts=2)
    [a] = ids(1)
    first = enq(q, a, "normal")
    q.pull(1, "w")
    assert q.requeue(a, "w:9", error="x") == 0  # fenced on the owner: nothing changes
    assert rr.zscore(q.keys.inflight, a) > 0 and rr.hget(q.keys.job(a), "error") is None
    assert q.requeue(a, "w:1", error="worker w failed: boom") == 1
    assert rr.zscore(q.keys.inflight, a) == 0  # the lease ended now, the job still in flight
    assert q.renew({a: "w:1"})[0] == [a]  # given up: its worker's heartbeat cannot renew it
    assert rr.zscore(q.keys.inflight, a) == 0
    assert q.reap() == (1, 0, 0, 0)  # the attempt counted
    [p] = q.pull(1, "w")
    assert p.attempt == 2 and p.score == pytest.approx(first.score)
    assert p.suspect == "worker w failed: boom"  # the worker runs it alone (worker.jobs.admit_now)
    assert q.requeue(a, "w:2", error="worker w failed: boom again") == 1
    assert q.reap() == (0, 1, 0, 0)
    h = rr.hgetall(q.keys.job(a))
    assert h[b"status"] == b"dead" and b"last error: worker w failed: boom again" in h[b"error"]


def test_a_suspect_cancelled_in_the_queue_ends_cancelled_without_the_old_failure(rr):
    from mlxq.producer.records import result_from_hash

    q = make_queue(rr)
    a, b = ids(2)
    for j in (a, b):
        enq(q, j, "normal")
    q.pull(2, "w")
    for j in (a, b):
        assert q.requeue(j, "w:1", error="worker w failed: boom") == 1
    assert q.reap() == (2, 0, 0, 0)
    assert q.cancel(a) == "cancelled"
    done = result_from_hash(a, rr.hgetall(q.keys.job(a)))
    assert done.finish_reason == "cancelled" and done.error is None
    rr.hset(q.keys.job(b), "status", "dead")  # a job that failed still says why
    assert result_from_hash(b, rr.hgetall(q.keys.job(b))).error == "worker w failed: boom"


def test_requeue_keeps_score_and_gives_the_attempt_back(rr):
    q = make_queue(rr)
    [a] = ids(1)
    first = enq(q, a, "low")
    q.pull(1, "w")
    assert q.requeue(a, "w:1", b"state") == 1
    [p] = q.pull(1, "w")
    assert p.attempt == 1 and p.resume == b"state" and p.score == pytest.approx(first.score)
    assert p.suspect == ""  # a plain requeue (preemption, a stop) is no failure


def test_garbage_members_are_moved_aside(rr):
    q = make_queue(rr)
    [a] = ids(1)
    rr.zadd(q.keys.queue, {"not-a-job": 0})
    enq(q, a, "normal")
    pulled = q.pull(5, "w")
    assert [(p.job_id, p.kind) for p in pulled] == [("not-a-job", "garbage"), (a, "job")]
    assert rr.zscore(q.keys.dead, "not-a-job") is not None
    # a forged member for a finished job never runs it twice
    q.complete(a, "w:1", "done", b"r")
    rr.zadd(q.keys.queue, {a: 0})
    assert q.pull(5, "w") == []


def test_a_record_with_a_hex_score_is_moved_aside_and_its_batch_mates_still_run(rr):
    """Lua's tonumber reads '0x10' (and ' 5' with its space), Python's float not the first: such a record passed the
    script's check and its float() raised in the worker, which lost every job of that pull (leased,
    never run, back only when their leases expired, with an attempt counted)."""
    q = make_queue(rr)
    a, b, c = ids(3)
    for j in (a, b, c):
        enq(q, j, "normal")
    rr.hset(q.keys.job(a), "score", "0x10")
    rr.hset(q.keys.job(b), "queued_at", " 5")
    pulled = q.pull(5, "w")
    assert sorted((p.job_id, p.kind) for p in pulled) == sorted([(a, "garbage"), (b, "garbage"), (c, "job")])
    assert rr.hget(q.keys.job(a), "error") == b"malformed job record: score is not a number"
    assert rr.hget(q.keys.job(b), "error") == b"malformed job record: queued_at is not a number"
    assert rr.hget(q.keys.job(c), "status") == b"running"


def _control(q, leases, stop, cancelled=None, lost=None, model_info=None):
    """A worker's control thread for one fake holder of ``leases``, its inbox's messages to the given lists."""
    import threading

    from mlxq.worker.control import Control

    inbox = SimpleNamespace(cancel=cancelled or (lambda ids: None), lost=lost or (lambda leases: None))
    stats = SimpleNamespace(snapshot={}, publish_soon=threading.Event())
    return Control.build(q, "w", [SimpleNamespace(leases=lambda: leases)], inbox, stats,
                         model_info=model_info or {}, registry_key=GK.models, stop=stop)


def test_one_entry_whose_preparing_raises_costs_the_rest_of_its_pull_nothing(rr):
    """The fetcher prepares a pull's entries one by one: what escapes ``prepare`` for one of them
    (a bug, or a panic from a Rust library: a BaseException) leaves that one to its lease, and the
    rest are still prepared; before, the whole pull was skipped (leased, never run)."""
    import threading

    from mlxq.worker.fetcher import Fetcher

    class Panic(BaseException):  # what pyo3 raises for a Rust panic
        pass

    q = make_queue(rr)
    jobs = ids(3)
    for j in jobs:
        enq(q, j, "normal")
    prepared, stop = [], threading.Event()

    def prepare(entry):
        if entry.job_id == jobs[0]:
            raise Panic("called `Option::unwrap()` on a `None` value")
        prepared.append(entry.job_id)
        if len(prepared) == 2:
            stop.set()

    capacity = SimpleNamespace(free_slots=lambda: 0 if stop.is_set() else 3, urgent_below=lambda: float("-inf"))
    fetcher = Fetcher(q, "w", capacity, prepare, stop, gather_s=0, idle_block_s=0.1)
    fetcher.start()
    fetcher.join(30)
    assert not fetcher.is_alive() and sorted(prepared) == sorted(jobs[1:])


def test_leases_are_renewed_while_the_rest_of_the_control_loop_fails(rr):
    """The control thread renews leases first and on its own: a failure in the rest of its loop
    (here every policy sync raising) does not starve the renewal; before, the renewal came after
    it in one try, never ran, and the reaper queued the running jobs again."""
    import threading

    q = make_queue(rr, lease_s=2.0, heartbeat_s=0.1)
    [a] = ids(1)
    enq(q, a, "normal")
    [p] = q.pull(1, "w")
    first = rr.zscore(q.keys.inflight, a)
    stop, renewed = threading.Event(), threading.Event()
    control = _control(q, {a: "w:1"}, stop)

    def broken():
        raise RuntimeError("the policy sync fails every time")

    control.reporter.prepare = broken
    control.start()
    try:
        for _ in range(300):
            if rr.zscore(q.keys.inflight, a) > first:
                renewed.set()
                break
            stop.wait(0.05)
    finally:
        stop.set()
        control.join(5)
    assert renewed.is_set()


def test_all_keys_of_a_model_share_one_hash_tag():
    k = ModelKeys("qwen-0.5b")
    keys = [k.queue, k.inflight, k.dead, k.counts, k.wake, k.job("ab"), k.events("ab"), k.idempotency("x")]
    assert all("{mlxq:qwen-0.5b}" in key for key in keys)
    with pytest.raises(ValueError):
        ModelKeys("bad{name}")


def test_junk_on_the_cancel_channel_is_dropped_and_a_real_cancel_still_works(rr, caplog):
    """Anyone who may publish on the cancel channel (every ACL producer) can send anything: bytes that
    are not UTF-8, text that is no job id, the id of a key that is not a job record. Each is logged
    and dropped; before, each raised into the control loop, which then skipped admission, stats and
    the reaper and slept half a second (a burst stopped them on every worker). A real cancel after
    them still takes its queued job out."""
    import logging
    import threading

    q = make_queue(rr, heartbeat_s=0.1)
    a, forged = ids(2)
    enq(q, a, "normal")
    rr.set(q.keys.job(forged), b"not a hash")  # WRONGTYPE for the cancel script
    stop, cancelled = threading.Event(), []
    control = _control(q, {}, stop, cancelled=cancelled.extend, model_info={"name": "m"})
    control.start()
    try:
        with caplog.at_level(logging.WARNING, logger="mlxq"):
            for _ in range(300):  # subscribed (the loop's first pass) before anything is published
                if rr.pubsub_numsub(q.keys.cancel_channel)[0][1]:
                    break
                stop.wait(0.05)
            for junk in (b"\xff\xfe\x00", b"not a job", forged.encode(), b"A" * 32):
                rr.publish(q.keys.cancel_channel, junk)
            rr.hset(q.keys.job(a), "cancel", "1")  # as cancel_request flags it
            rr.publish(q.keys.cancel_channel, a)
            for _ in range(300):
                if cancelled:
                    break
                stop.wait(0.05)
    finally:
        stop.set()
        control.join(5)
    assert cancelled == [a] and rr.hget(q.keys.job(a), "status") == b"cancelled"
    assert not [r for r in caplog.records if "control loop error" in r.getMessage()]
    assert sum("cancel" in r.getMessage() for r in caplog.records) == 4  # each junk message named once


def test_a_job_flagged_for_cancelling_is_never_leased_again(rr):
    """A cancel that comes while a job runs flags it (cancel.lua, cancel_request.lua); if the worker
    hands the job back before its next renew tells it (a preemption, a warm shutdown), the requeue
    ends it cancelled: queued again, the next worker leased it and ran it on. And a queued job
    flagged by a cancel request no worker acted on ends cancelled when pulled, instead of running."""
    q = make_queue(rr)
    a, b = ids(2)
    enq(q, a, "normal")
    [p] = q.pull(1, "w")
    assert q.cancel(a) == "cancelling"
    assert q.requeue(a, f"w:{p.attempt}", resume=b"state") == 1
    enq(q, b, "normal")
    rr.hset(q.keys.job(b), "cancel", "1")  # as cancel_request.lua flags a queued, admitted job
    assert q.pull(2, "w2") == []
    for job_id in (a, b):
        assert rr.hget(q.keys.job(job_id), "status") == b"cancelled"
        assert not rr.hexists(q.keys.job(job_id), "resume")
        last = rr.xrevrange(q.keys.events(job_id), count=1)[0][1]
        assert last[b"f"] == b"cancelled"
    assert rr.zcard(q.keys.queue) == 0 and rr.zcard(q.keys.inflight) == 0
    counts = {k.decode(): int(v) for k, v in rr.hgetall(q.keys.counts).items()}
    assert counts["queued:normal"] == 0 and counts["running"] == 0 and counts["cancelled"] == 2


def test_a_job_id_that_is_not_32_lowercase_hex_digits_is_refused(rr):
    """pull and admit take only new_job_id's form; a job enqueued or submitted under another id (a
    producer in another language writing upper-case hex, a uuid with dashes) was accepted, then
    dropped as garbage: its caller waited for ever with no error. Now enqueue and submit refuse it."""
    from mlxq.shared.protocol import JobRefused, function_name, load_functions

    q = make_queue(rr)
    for bad in ("A" * 32, "0123", "1b4e28ba-2fa1-11d2-883f-0016d3cca427", "g" * 32):
        with pytest.raises(JobRefused, match="hex"):
            q.enqueue(bad, b"x", apikeys.key_hash(TIER_KEYS["normal"]), None, None)
        assert not rr.exists(q.keys.job(bad))
    load_functions(rr)
    k = q.keys
    reply = rr.fcall(function_name("submit"), 4, k.job("A" * 32), k.job("A" * 32), k.intake, k.wake, "A" * 32, b"req",
                     "", "", "0", 60)
    assert reply[0] == b"invalid_id" and not rr.exists(k.job("A" * 32)) and rr.llen(k.intake) == 0
    assert q.counts().get("queued:normal", 0) == 0


def test_a_lost_lease_is_reported_with_the_owner_token_that_lost_it(rr):
    """The heartbeat names the owner token with each lost job, so the worker can tell that lease from a
    newer one it took since (see test_hostwork's test_a_lost_lease_ends_only_the_attempt_that_lost_it)."""
    import threading

    q = make_queue(rr)
    a, b = ids(2)
    for job_id in (a, b):
        enq(q, job_id, "normal")
    pulled = {p.job_id: owner_token("w", p.attempt) for p in q.pull(2, "w")}
    lost = []
    control = _control(q, {a: "w:9", b: pulled[b]}, threading.Event(), lost=lost.extend)
    control.heartbeat.renew()
    assert lost == [(a, "w:9")]


def test_every_key_a_script_touches_is_declared_in_keys(rr):
    """A Redis Cluster routes a script by its declared keys and may refuse one that touches another:
    no script call names a key of the model among its arguments (channels are not keys). submit named
    the intake and wake lists in ARGV."""
    q = make_queue(rr)
    k = q.keys
    [a] = ids(1)
    kh = apikeys.key_hash(TIER_KEYS["low"])
    calls = [q.calls.enqueue(a, b"x", kh, None, "i"), q.calls.check(kh, None), q.calls.submit(a, b"x", kh, None, "i"),
             q.calls.cancel_request(a), q.calls.admit([a]), q.calls.pull([a], "w"),
             q.calls.deltas([(a, "w:1", b"d", 1)]), q.calls.complete(a, "w:1", "done", b"r", b""),
             q.calls.requeue(a, "w:1"), q.calls.cancel(a), q.calls.renew({a: "w:1"}), q.calls.reap([a])]
    channels = (k.channel(a), k.cancel_channel)
    for name, _, args in calls:
        named = [x for x in args if isinstance(x, str) and x.startswith(k.prefix + ":") and x not in channels]
        assert named == [], name


def test_a_requeued_job_keeps_its_record_while_it_waits(rr):
    """A job handed back (preemption, warm shutdown) or requeued by the reaper may wait in the queue
    longer than the record's TTL: its stream of what was already emitted, which its resume reads,
    expired while it waited. Queued or running, the stream has no TTL (as the job hash), however long
    the job waits or runs; a record whose job vanished expires."""
    q = make_queue(rr, lease_s=0.05, heartbeat_s=0.01, max_attempts=3)
    a, b = ids(2)
    enq(q, a, "normal")
    ek = q.keys.events(a)
    q.pull(1, "w")
    publish_deltas(q, [(a, "w:1", b"d1", 1)])
    rr.expire(ek, 5)  # (a stream an older worker gave a TTL at its first delta)
    publish_deltas(q, [(a, "w:1", b"d2", 2)])
    assert q.requeue(a, "w:1", b"state") == 1  # a preemption
    assert rr.ttl(ek) == -1
    [p] = q.pull(1, "w")
    publish_deltas(q, [(a, f"w:{p.attempt}", b"d3", 3)])
    assert rr.ttl(ek) == -1
    rr.expire(ek, 5)
    rr.zadd(q.keys.inflight, {a: 0}, xx=True)  # (its lease expired)
    assert q.reap() == (1, 0, 0, 0)
    assert rr.ttl(ek) == -1
    assert [f[b"d"] for _, f in rr.xrange(ek)] == [b"d1", b"d2", b"d3"]
    rr.delete(q.keys.job(a))  # the record of a waiting job vanished: garbage, and its stream expires
    assert [x.kind for x in q.pull(1, "w")] == ["garbage"]
    assert rr.ttl(ek) > 0
    enq(q, b, "normal")  # a running job whose record vanished: the reaper drops it, and its stream expires
    q.pull(1, "w")
    publish_deltas(q, [(b, "w:1", b"d1", 1)])
    rr.persist(q.keys.events(b))
    rr.delete(q.keys.job(b))
    rr.zadd(q.keys.inflight, {b: 0}, xx=True)
    q.reap()
    assert rr.ttl(q.keys.events(b)) > 0


def test_an_idempotency_key_whose_job_is_gone_is_no_duplicate(rr):
    """A key that names a job whose record expired or was deleted answered ``duplicate`` with that
    job's id: its caller waited on a job nobody can read. Such a key is treated as absent."""
    q = make_queue(rr)
    a, b, c = ids(3)
    assert enq(q, a, "low", "order-7").status == "ok"
    assert enq(q, b, "low", "order-7").status == "duplicate"
    rr.zrem(q.keys.queue, a)
    rr.delete(q.keys.job(a))  # (expired)
    again = enq(q, b, "low", "order-7")
    assert again.status == "ok" and again.job_id == b and rr.exists(q.keys.job(b))
    idem = q.keys.idempotency("order-7", apikeys.key_hash(TIER_KEYS["low"]))
    assert rr.get(idem) == b.encode() and rr.hget(q.keys.job(b), "idem") == idem.encode()
    dup = enq(q, c, "low", "order-7")
    assert dup.status == "duplicate" and dup.job_id == b


def test_a_submit_from_an_older_producer_is_refused_before_any_write(rr):
    """A producer older than the function library named the intake and wake lists in ARGV (2 KEYS):
    the record was written, then the push failed, and the job stayed queued for no worker while the
    producer's retry was told "ok". Now the call is refused first, saying what to do."""
    from mlxq.shared.protocol import function_name, load_functions

    q = make_queue(rr)
    load_functions(rr)
    k = q.keys
    [a] = ids(1)
    with pytest.raises(redis.ResponseError, match="older than the workers; upgrade it"):
        rr.fcall(function_name("submit"), 2, k.job(a), k.job(a), a, b"req", "", "", "0", 60, k.intake, k.wake)
    assert not rr.exists(k.job(a)) and rr.llen(k.intake) == 0
