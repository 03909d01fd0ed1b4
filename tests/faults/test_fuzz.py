"""Fuzz: 10,000 garbage or mutated entries pushed straight into Redis, interleaved with good jobs.

The worker must stay alive, every good job must complete with the greedy text, and every bad
entry must end in a clear error on its result or in the dead-letter set.  Hypothesis drives the
request decoder and the pull script with arbitrary input as well."""

from __future__ import annotations

import math
import random
import time
from collections import Counter

import redis
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from mlxq import Client
from mlxq.shared import codec
from mlxq.shared.keys import ModelKeys
from mlxq.shared.protocol import Pulled, Queue
from mlxq.shared.settings import Settings
from workerkit import fast_settings, running_worker, wait_for
from faultkit import record, reference_tokens

K = ModelKeys("tiny")
N_BAD = 10_000
MAX_NEW = 8  # the fuzz worker refuses max_tokens above this: mutated jobs stay short


def _valid_request(job_id, rng):
    return {"id": job_id, "model": "tiny", "prompt_tokens": [rng.randrange(4, 1000) for _ in range(rng.randrange(1, 8))],
            "max_tokens": rng.randrange(1, 4), "temperature": 0.0, "source": "client", "submitted_at": time.time()}


def _random_obj(rng, depth=0):
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.randrange(-2**63, 2**64)
    if kind == 1:
        return rng.random() * 10 ** rng.randrange(-5, 300) * rng.choice((1, -1))
    if kind == 2:
        return "".join(chr(rng.randrange(0, 0x2FFF)) for _ in range(rng.randrange(0, 20)))
    if kind == 3:
        return rng.randbytes(rng.randrange(0, 20))
    if kind == 4:
        return rng.choice([None, True, False, float("nan"), float("inf")])
    if kind == 5:
        return rng.choice(["tiny", "prompt", "max_tokens", "messages", "id", ""])
    if kind == 6:
        return [_random_obj(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    keys = ["id", "model", "prompt", "prompt_tokens", "messages", "max_tokens", "temperature", "stop", "seed", "x"]
    return {rng.choice(keys): _random_obj(rng, depth + 1) for _ in range(rng.randrange(0, 6))}


def _wrong_types(job_id, rng):
    base = _valid_request(job_id, rng)
    choice = rng.randrange(8)
    if choice == 0:
        return _random_obj(rng)  # anything at all
    if choice == 1:
        base[rng.choice(list(base))] = _random_obj(rng)
    elif choice == 2:
        base.pop("prompt_tokens")
        base["messages"] = [{"role": _random_obj(rng), "content": _random_obj(rng)}]
    elif choice == 3:
        base["prompt"] = rng.choice([5, b"bytes", ["list"], {"a": 1}, ""])
        base.pop("prompt_tokens")
    elif choice == 4:
        base["model"] = rng.choice(["other-model", "", "tiny" * 100])
    elif choice == 5:
        base["id"] = rng.choice(["0" * 32, "not-hex", job_id.upper()])
    elif choice == 6:
        base["stop"] = [_random_obj(rng) for _ in range(3)]
    else:
        base[rng.choice(["bogus", "tier", "priority", "__class__"])] = "high"  # extra fields are refused
    return base


def _huge(job_id, rng):
    base = _valid_request(job_id, rng)
    choice = rng.randrange(7)
    if choice == 0:
        base["max_tokens"] = rng.choice([10**12, 2**63 - 1, MAX_NEW + 1, 10**6])
    elif choice == 1:
        base["prompt_tokens"] = [rng.randrange(10**6, 10**9)]
    elif choice == 2:
        base["prompt_tokens"] = [7] * 5000  # longer than the context (4096)
    elif choice == 3:
        base["stop"] = ["x"] * 1000
    elif choice == 4:
        base["temperature"] = 1e308
    elif choice == 5:
        base["seed"] = -1
    else:
        base["top_k"] = 2**64 - 1
    return base


def _mutate(data: bytes, rng) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(4)
        if op == 0 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1 and b:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
        else:
            b += rng.randbytes(rng.randrange(1, 8))
    return bytes(b)


def _hex(rng):
    return rng.randbytes(16).hex()


def _push_bad_entries(r: redis.Redis, rng: random.Random, n: int):
    """Write ``n`` bad entries straight into Redis (pipelined). Returns [(category, member)]."""
    now = time.time()
    entries = []
    pipe = r.pipeline(transaction=False)
    weights = {"member-no-record": 14, "member-not-an-id": 10, "raw-bytes-req": 14, "wrong-types": 16,
               "huge-values": 10, "mutated-valid": 20, "bogus-job-hash": 10, "wrong-key-type": 4,
               "forged-member-finished-job": 2}
    cats = rng.choices(list(weights), weights=list(weights.values()), k=n)
    for i, cat in enumerate(cats):
        score = now + rng.uniform(-5, 60)  # interleaved with the good jobs (normal tier: now + 30)
        job_id = _hex(rng)
        jk = K.job(job_id)
        fields = {"status": "queued", "tier": "normal", "score": f"{score:.6f}", "attempts": "0",
                  "queued_at": f"{now:.6f}"}
        if cat == "member-no-record":
            member = job_id
            fields = None
        elif cat == "member-not-an-id":
            fields = None
            member = rng.choice([rng.randbytes(rng.randrange(1, 40)), b"\xff\xfe" + rng.randbytes(4),
                                 "../" + job_id, job_id.upper(), job_id + "0", "*", " "])
            if i % 2000 == 0:
                member = rng.randbytes(64 * 1024)  # a huge member
        elif cat == "raw-bytes-req":
            member = job_id
            fields["req"] = rng.choice([rng.randbytes(rng.randrange(0, 64)), b"\xc1", b"", b"\x81\xa2id"])
            if i % 2500 == 0:
                fields["req"] = rng.randbytes(512 * 1024)
        elif cat == "wrong-types":
            member = job_id
            fields["req"] = codec.pack(_wrong_types(job_id, rng))
        elif cat == "huge-values":
            member = job_id
            fields["req"] = codec.pack(_huge(job_id, rng))
        elif cat == "mutated-valid":
            member = job_id
            fields["req"] = _mutate(codec.pack(_valid_request(job_id, rng)), rng)
        elif cat == "bogus-job-hash":
            member = job_id
            fields["req"] = codec.pack(_valid_request(job_id, rng))
            bad = rng.randrange(6)
            if bad == 0:
                fields["attempts"] = rng.choice(["abc", "1.5", "99999999999999999999", "-1", ""])
            elif bad == 1:
                fields["tier"] = rng.choice(["ultra", "", "HIGH"])
            elif bad == 2:
                fields["score"] = rng.choice(["nan", "abc", "inf", ""])
            elif bad == 3:
                del fields["score"]
            elif bad == 4:
                fields["queued_at"] = "yesterday"
            else:
                del fields["status"]
        elif cat == "wrong-key-type":
            member = job_id
            kind = rng.randrange(3)
            if kind == 0:
                pipe.set(jk, b"not a hash")
            elif kind == 1:
                pipe.rpush(jk, b"a", b"b")
            else:
                pipe.sadd(jk, b"x")
            fields = None
        else:  # a member forged for a job that already finished: it must not run twice
            member = job_id
            fields = {"status": "done", "result": codec.pack({"id": job_id, "text": "kept", "finish_reason": "stop"}),
                      "tier": "normal", "score": "1", "attempts": "1"}
        if fields:
            pipe.hset(jk, mapping=fields)
        pipe.zadd(K.queue, {member: score})
        entries.append((cat, member))
        if len(pipe) >= 2000:
            pipe.execute()
    # forged in-flight members with expired deadlines, junk wake-ups and cancel messages
    for i in range(50):
        job_id = _hex(rng)
        if i % 2:
            pipe.set(K.job(job_id), b"clobbered")
        pipe.zadd(K.inflight, {job_id: now - 100})
        entries.append(("forged-inflight", job_id))
    pipe.lpush(K.wake, *[rng.randbytes(8) for _ in range(50)])
    for _ in range(20):
        pipe.publish(K.cancel_channel, rng.randbytes(rng.randrange(1, 40)))
    pipe.execute()
    return entries


def _outcome(r, cat, member, job_id_ok):
    if r.zscore(K.dead, member) is not None:
        why = r.hget(K.dead_info, member)
        return "dead-letter" if why else "dead-letter without a reason"
    if not job_id_ok:
        return "unaccounted"
    h = r.hgetall(K.job(member)) if r.type(K.job(member)) == b"hash" else {}
    status = h.get(b"status")
    if status == b"failed":
        res = codec.unpack(h[b"result"])
        return "failed with error" if res.get("error") and res.get("finish_reason") == "error" else "failed, no error"
    if status == b"dead":
        return "dead with error" if h.get(b"error") else "dead, no error"
    if status == b"done":
        if cat == "forged-member-finished-job":
            return "not re-run" if codec.unpack(h[b"result"])["text"] == "kept" else "RE-RUN"
        return "ran (mutation left it valid)"
    if cat == "forged-inflight" and not h:
        return "dropped (no record)"
    return f"unaccounted ({status!r})"


def test_ten_thousand_bad_entries_interleaved_with_good_jobs(tiny_model, redis_url):
    rng = random.Random(20240601)
    good_specs = [([rng.randrange(4, 1000) for _ in range(rng.randrange(2, 12))], rng.randrange(2, 6))
                  for _ in range(40)]
    refs = [reference_tokens(tiny_model, p, n) for p, n in good_specs]
    settings = fast_settings(redis_url, max_new_tokens=MAX_NEW)
    client = Client(redis_url, model="tiny", settings=settings)
    r = client.redis
    t0 = time.monotonic()
    good = []
    entries = []
    # good jobs go in between four slices of bad entries, so both are mixed in the queue
    for part in range(4):
        entries += _push_bad_entries(r, rng, N_BAD // 4)
        good += [client.submit(prompt_tokens=p, max_tokens=n) for p, n in good_specs[part * 10:(part + 1) * 10]]
    push_s = time.monotonic() - t0
    assert r.zcard(K.queue) >= N_BAD * 0.95  # (a few random members collide)
    with running_worker(tiny_model, redis_url, settings, max_batch=32) as w:
        results = [j.result(timeout=120) for j in good]
        assert wait_for(lambda: r.zcard(K.queue) == 0 and r.zcard(K.inflight) == 0 and not w.active, timeout=120)
        alive = all(t.is_alive() for t in (w.fetcher, w.control, w.publisher))
        after = client.submit(prompt_tokens=[5, 6, 7], max_tokens=2).result(timeout=30)
    run_s = time.monotonic() - t0 - push_s
    assert alive and after.finish_reason in ("stop", "length")
    good_ok = sum(res.token_ids == ref and res.finish_reason in ("stop", "length") for res, ref in zip(results, refs))
    tally: Counter = Counter()
    per_cat: dict = {}
    for cat, member in entries:
        ok_id = isinstance(member, str) and len(member) == 32 and all(c in "0123456789abcdef" for c in member)
        out = _outcome(r, cat, member, ok_id)
        tally[out] += 1
        per_cat.setdefault(cat, Counter())[out] += 1
    for cat, c in sorted(per_cat.items()):
        print(f"  {cat:28s} {dict(c)}")
    unaccounted = sum(v for k, v in tally.items() if k not in (
        "dead-letter", "failed with error", "dead with error", "ran (mutation left it valid)", "not re-run",
        "dropped (no record)"))
    record("fuzz (10k bad entries + 40 good jobs)", len(good), good_ok, len(good) - good_ok, 0,
           bad_entries=len(entries), bad_accounted=len(entries) - unaccounted, push_s=round(push_s, 1),
           run_s=round(run_s, 1), **{k.replace(" ", "_"): v for k, v in tally.items()})
    assert good_ok == len(good)
    assert unaccounted == 0, dict(tally)
    # the reasons are clear
    reasons = Counter()
    for cat, member in entries[:3000]:
        h = r.hgetall(K.job(member)) if isinstance(member, str) and r.type(K.job(member)) == b"hash" else {}
        if h.get(b"status") == b"failed":
            err = codec.unpack(h[b"result"])["error"]
            reasons[err.split(":")[0].split(" ")[0]] += 1
            assert any(w_ in err for w_ in ("malformed", "invalid", "unknown model", "exceeds", "outside", "never fit",
                                            "tokenizes", "context")), err
    print("  failure reasons (first words):", dict(reasons))


# -- hypothesis: the decoder and the pull script on arbitrary input ----------------------------

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=30)
    | st.binary(max_size=30),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=20,
)


def _pulled(job_id, raw):
    return Pulled(job_id=job_id, kind="job", raw_request=raw, attempt=1, tier="normal", score=0.0, queued_at=0.0,
                  resume=b"", now=0.0)


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=200), msgpack_values.map(lambda v: codec.pack(v)),
                 st.fixed_dictionaries({}, optional={"id": msgpack_values, "model": msgpack_values,
                                                     "prompt": msgpack_values, "prompt_tokens": msgpack_values,
                                                     "max_tokens": msgpack_values, "stop": msgpack_values,
                                                     "temperature": msgpack_values}).map(codec.pack)))
def test_decode_request_only_ever_raises_job_error(raw):
    from mlxq.worker.jobs import JobError, decode_request

    job_id = "ab" * 16
    try:
        req = decode_request(_pulled(job_id, raw), "tiny", 64)
    except JobError as exc:
        assert str(exc)
        return
    assert req.id == job_id and req.model == "tiny" and req.max_tokens <= 64


field_text = st.one_of(st.text(max_size=12), st.sampled_from(["0", "1", "-1", "nan", "inf", "1e400", "high", "normal",
                                                              "low", "queued", "running", "done", "1.5",
                                                              "99999999999999999999"]))


@hsettings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["status", "attempts", "tier", "score", "queued_at", "req", "resume"]),
                       field_text, max_size=7),
       st.binary(min_size=1, max_size=40))
def test_pull_never_errors_and_never_loses_the_good_job_beside_a_bad_record(redis_server, fields, member):
    r = redis.Redis.from_url(redis_server.url)
    k = ModelKeys("fz")
    q = Queue(r, k, Settings())
    try:
        r.delete(k.queue, k.inflight, k.dead, k.dead_info, k.counts)
        bad_id, good_id = "e" * 32, "a" * 32
        r.delete(k.job(bad_id), k.job(good_id))
        if fields:
            r.hset(k.job(bad_id), mapping=fields)
        r.zadd(k.queue, {bad_id: 1.0, member: 2.0})
        q.enqueue(good_id, b"req", global_redis=r)  # anonymous: normal
        pulled = q.pull(10, "w")  # never a script error
        got = {p.job_id: p.kind for p in pulled}
        assert got.get(good_id) == "job"  # the good job is leased, not lost
        assert r.zcard(k.queue) == 0
        if got.get(bad_id) == "job":
            p = next(p for p in pulled if p.job_id == bad_id)
            assert math.isfinite(p.score) and p.attempt >= 1 and p.tier in ("high", "normal", "low")
        else:
            status = r.hget(k.job(bad_id), "status")
            assert r.zscore(k.dead, bad_id) is not None or (status not in (None, b"queued"))
        q.reap()  # the reaper copes with whatever is in flight
    finally:
        r.close()


def test_reaper_and_heartbeat_survive_clobbered_records(redis_url):
    r = redis.Redis.from_url(redis_url)
    q = Queue(r, ModelKeys("fz"), Settings(lease_s=0.05, heartbeat_s=0.01))
    a, b = "a" * 32, "b" * 32
    q.enqueue(a, b"x", global_redis=r)  # anonymous: normal
    q.enqueue(b, b"x", global_redis=r)  # anonymous: normal
    assert len(q.pull(2, "w")) == 2
    r.set(q.keys.job(a), b"clobbered")  # the record of a running job is overwritten with a string
    lost, cancel = q.renew({a: "w:1", b: "w:1"})
    assert lost == [a] and cancel == []  # the other lease is still renewed
    r.hset(q.keys.job(b), "score", "nan")
    time.sleep(0.1)
    assert q.reap() == (0, 1, 0, 0)  # b cannot be requeued at a NaN score: dead-lettered with the reason
    assert b"malformed" in r.hget(q.keys.job(b), "error")
    assert r.zscore(q.keys.dead, a) is not None and r.zscore(q.keys.dead, b) is not None
