"""Fair shares between API keys within a tier, decided by the scripts on a real Valkey (no worker):
pick.lua serves the keys with work at a tier in turn (weighted), oldest first within a key."""

from __future__ import annotations

import pytest
import redis
from redis.crc import key_slot

from mlxq.shared import apikeys, codec
from mlxq.shared.keys import GlobalKeys, ModelKeys
from mlxq.shared.protocol import Queue
from mlxq.shared.settings import Settings

GK = GlobalKeys()
KEYS = {"a": "key-of-tenant-a", "b": "key-of-tenant-b", "c": "key-of-tenant-c"}


@pytest.fixture
def q(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.hset(GK.models, "m", b"")
    for name, key in KEYS.items():
        apikeys.add_key(r, GK, key, "low", name=name)
    settings = Settings()
    apikeys.set_policy(r, GK, settings.tier_offsets, 100_000, anonymous="low")
    q = Queue(r, ModelKeys("m"), settings)
    q.load_scripts()
    yield q
    r.close()


def flood(q: Queue, who: str | None, n: int, start: int) -> list[str]:
    """Enqueue ``n`` jobs as key ``who`` (None: no key), in one pipeline; their ids, in order."""
    ids = [f"{start + i:032x}" for i in range(n)]
    kh = apikeys.key_hash(KEYS[who]) if who else None
    pipe = q.redis.pipeline(transaction=False)
    for job_id in ids:
        q.queue_call(pipe, q.calls.enqueue(job_id, b"x", kh, None, None))
    assert all(reply[0] == b"ok" for reply in pipe.execute())
    return ids


def pulled(q: Queue, n: int, batch: int = 8) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        got = q.pull(min(batch, n - len(out)), "w")
        assert got, "the queue ran dry"
        out += [p.job_id for p in got]
    return out


def test_a_flood_does_not_starve_another_keys_first_jobs(q):
    """The figure (docs/pipelines/fair-shares.md): key A floods 2,000 low-tier jobs, then key B submits
    10: B's 10 are all pulled before A's next 20. Without turns B waited behind all 2,000."""
    a = flood(q, "a", 2000, 1)
    assert pulled(q, 16) == a[:16]  # A alone: oldest first
    b = flood(q, "b", 10, 100_000)
    order = pulled(q, 30)
    assert set(b) <= set(order[:20])  # all 10 of B's before A's 11th next job, so before its 20th
    assert [j for j in order if j in set(b)] == b  # oldest first within a key
    assert [j for j in order if j not in set(b)] == a[16:36]  # A keeps its order too


def test_weights_share_a_tier(q):
    """A key of weight 3 is served three times as often as one of weight 1 while both have work."""
    apikeys.set_limits(q.redis, GK, "a", weight=3)
    a, b = flood(q, "a", 60, 1), flood(q, "b", 60, 1000)
    order = pulled(q, 40)
    served_a = sum(j in set(a) for j in order)
    assert 29 <= served_a <= 31, served_a
    assert [k["weight"] for k in apikeys.list_keys(q.redis, GK) if k["name"] == "a"] == [3.0]


def test_jobs_without_a_key_form_one_group(q):
    """Callers without a key share one turn: their flood does not starve a key's job, nor the reverse."""
    anon = flood(q, None, 100, 1)
    c = flood(q, "c", 3, 1000)
    order = pulled(q, 6, batch=1)
    assert sorted(order) == sorted(anon[:3] + c)


def test_tiers_still_decide_across_tiers(q):
    """Turns are taken within a tier; across tiers the score (tier offset + age) decides as before."""
    apikeys.add_key(q.redis, GK, "key-of-high-tier", "high", name="h")
    low = flood(q, "a", 5, 1)
    kh = apikeys.key_hash("key-of-high-tier")
    high = f"{999:032x}"
    q.enqueue(high, b"x", kh)
    assert pulled(q, 6, batch=6) == [high, *low]


def test_cancelled_and_requeued_jobs_keep_the_queue_whole(q):
    """A job cancelled while indexed is dropped on the way; one put back (preemption) is taken by its
    score; a job queued by a caller that does not index (an older producer: 8 keys) is taken too."""
    a = flood(q, "a", 4, 1)
    assert q.cancel(a[0]) == "cancelled"
    [first] = q.pull(1, "w")
    assert first.job_id == a[1]
    assert q.requeue(a[1], "w:1") == 1
    old = f"{777:032x}"
    call = q.calls.enqueue(old, b"x", None, None, None)
    assert q.redis.evalsha(q._scripts["enqueue"].sha, 8, *call[1][:8], *call[2])[0] == b"ok"
    assert sorted(pulled(q, 4, batch=4)) == sorted([a[1], a[2], a[3], old])
    assert q.pull(4, "w") == [] and q.redis.zcard(q.keys.fair_jobs) == 0


def test_fair_keys_share_the_models_slot():
    """Every key the fair scripts touch carries the model's hash tag (one cluster slot)."""
    k = ModelKeys("m")
    assert {key_slot(x.encode()) for x in [*k.fair_keys, k.queue, k.policy]} == {key_slot(k.queue.encode())}


def test_a_key_at_its_cap_waits_until_one_of_its_jobs_ends(q):
    """A key's cap on jobs in flight: its jobs are skipped at pick and pull while it holds that many,
    and others' jobs run; when one of its jobs ends (completed, given back, reaped), the next runs."""
    apikeys.set_limits(q.redis, GK, "a", max_inflight=2)
    a, b = flood(q, "a", 5, 1), flood(q, "b", 3, 1000)
    got = [p.job_id for p in q.pull(8, "w")]
    assert sorted(got) == sorted(a[:2] + b)  # A's other three wait
    assert q.pull(8, "w") == []
    assert q.complete(a[0], "w:1", "done", b"r") == 1
    assert [p.job_id for p in q.pull(8, "w")] == [a[2]]
    assert q.requeue(a[1], "w:1") == 1  # given back (preempted): it runs next, by its score
    assert [p.job_id for p in q.pull(8, "w")] == [a[1]]
    apikeys.set_limits(q.redis, GK, "a", max_inflight=0)  # the cap lifted: the rest run
    assert q.complete(a[1], "w:1", "done", b"r") == 1  # (a requeue gives its attempt back)
    assert sorted(p.job_id for p in q.pull(8, "w")) == sorted(a[3:])
    run = b"run:" + apikeys.copy_field(apikeys.key_hash(KEYS["a"])).encode()
    assert q.redis.hget(q.keys.fair_state, run) == b"3"
    assert q.requeue(a[2], "w:1", error="engine raised") == 1  # its lease ends at the reaper
    assert q.redis.hget(q.keys.fair_state, run) == b"3"
    assert q.reap().requeued == 1 and q.redis.hget(q.keys.fair_state, run) == b"2"


def test_usage_keeps_92_days(q):
    """The first count of a day drops the days past the 92 kept (one pass a day over the usage hash)."""
    today = int(q.redis.time()[0]) // 86400
    group = apikeys.copy_field(apikeys.key_hash(KEYS["a"]))
    q.redis.hset(q.keys.usage, mapping={f"{today - 92}|{group}|prompt": 5, f"{today - 91}|{group}|prompt": 7,
                                        "day": today - 1})
    [job] = flood(q, "a", 1, 1)
    q.pull(1, "w")
    assert q.complete(job, "w:1", "done", b"r", usage=(3, 2)) == 1
    fields = {k.decode(): int(v) for k, v in q.redis.hgetall(q.keys.usage).items()}
    assert fields == {f"{today - 91}|{group}|prompt": 7, "day": today, f"{today}|{group}|prompt": 3,
                      f"{today}|{group}|completion": 2, f"{today}|{group}|jobs": 1}


def test_a_key_is_parked_only_for_leases_it_holds(q):
    """A pick that reaches a key's cap with the jobs it chose passes the key over without parking it:
    a chosen job that is then not leased (cancelled meanwhile) leaves the key free to run the next."""
    apikeys.set_limits(q.redis, GK, "a", max_inflight=1)
    a = flood(q, "a", 3, 1)
    chosen = q.run(q.calls.pick(8))
    assert [m.decode() for m in chosen] == a[:1]
    assert q.cancel(a[0]) == "cancelled"
    assert q.run(q.calls.pull(chosen, "w")) == []
    assert [p.job_id for p in q.pull(8, "w")] == [a[1]]


def server_now(r) -> float:
    sec, usec = r.time()
    return sec + usec / 1e6


def indexed(q: Queue, job_id: str) -> dict:
    """What the fair state and index hold of a job: its group (g:), its member (j:), its fairq members."""
    r = q.redis
    return {"g": r.hget(q.keys.fair_state, f"g:{job_id}"), "j": r.hget(q.keys.fair_state, f"j:{job_id}"),
            "fairq": [m for m in r.zrange(q.keys.fair_jobs, 0, -1) if m.endswith(job_id.encode())]}


def test_a_deferred_job_takes_its_keys_turn_once_promoted_and_is_metered(q):
    """A deferred job is not indexed while it waits (a pick would find it not queued and drop it), only
    its group is kept; promoted, it takes its key's turn (ahead of A's flood, though its score, from its
    run_at, is later), counts against its key's jobs in flight, and its tokens are its key's."""
    a = flood(q, "a", 40, 1)
    job = f"{100_000:032x}"
    kh = apikeys.key_hash(KEYS["b"])
    group = apikeys.copy_field(kh).encode()
    assert q.enqueue(job, codec.pack({"run_at": server_now(q.redis) + 600}), kh).status == "ok"
    assert q.redis.zscore(q.keys.deferred, job) and indexed(q, job) == {"g": group, "j": None, "fairq": []}
    assert pulled(q, 4) == a[:4]  # not due: A alone
    q.redis.zadd(q.keys.deferred, {job: server_now(q.redis) - 1}, xx=True)  # (its time has come)
    assert job in [p.job_id for p in q.pull(2, "w")]  # by score alone it would wait behind A's 36
    run = b"run:" + group
    assert q.redis.hget(q.keys.fair_state, run) == b"1"
    assert q.complete(job, "w:1", "done", b"r", usage=(7, 3)) == 1
    day = f"{int(server_now(q.redis)) // 86400}|{group.decode()}|"
    usage = q.redis.hmget(q.keys.usage, day + "prompt", day + "completion", day + "jobs")
    assert usage == [b"7", b"3", b"1"]
    assert q.redis.hget(q.keys.fair_state, run) is None and indexed(q, job) == {"g": None, "j": None, "fairq": []}


def test_an_expired_job_leaves_no_fair_index_entry(q):
    """An expired job leaves fair shares as it ends: swept while queued (indexed) or deferred (its group
    kept), or met by a pull after a pick."""
    kh = apikeys.key_hash(KEYS["a"])
    now = server_now(q.redis)
    queued, deferred, picked = (f"{i:032x}" for i in (1, 2, 3))
    lives = {queued: {"expires_at": now + 600}, deferred: {"run_at": now + 300, "expires_at": now + 600},
             picked: {"expires_at": now + 600}}
    for job, life in lives.items():
        assert q.enqueue(job, codec.pack(life), kh).status == "ok"
    assert indexed(q, queued)["j"] and indexed(q, deferred)["g"] and indexed(q, picked)["j"]
    past = server_now(q.redis) - 1  # their expires_at passes (as time would)
    for job in lives:
        q.redis.hset(q.keys.job(job), "expires_at", f"{past:.6f}")
    q.redis.zadd(q.keys.expiring, {picked: now + 600, queued: past, deferred: past}, xx=True)
    assert q.sweep_expired(server_now(q.redis)) == 2
    assert q.pull(4, "w") == []  # the pick chose `picked`; the pull ends it expired
    for job in lives:
        assert q.redis.hget(q.keys.job(job), "status") == b"expired"
        assert indexed(q, job) == {"g": None, "j": None, "fairq": []}
