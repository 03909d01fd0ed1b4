"""A job whose worker dies mid-stream resumes from its durable record: the next attempt prefills the
prompt plus the tokens already published and generates only what is missing.  Every delta carries
the absolute index of its first token (and offset of its text), so a subscriber keeps one copy of
each; a seeded sampled job gives the same tokens whether or not its worker crashed."""

from __future__ import annotations

import random
from functools import partial
from types import SimpleNamespace

import redis

from mlxq import Client
from mlxq.producer.records import StreamState
from mlxq.producer.core import feed_message
from mlxq.shared import codec
from mlxq.shared.keys import ModelKeys
from mlxq.shared.schemas import Delta
from mlxq.shared.replay import read_payloads
from mlxq.worker.jobs import read_samples
from workerkit import fast_settings, read_published
from faultkit import StreamCollector, WorkerProc, reference_tokens, wait_registered

K = ModelKeys("tiny")


def _d(index, ids, offset, text, seq=0, attempt=1, finish=None):
    return Delta(attempt=attempt, seq=seq, index=index, offset=offset, text=text, token_ids=ids,
                 finish_reason=finish)


def test_stream_state_keeps_one_copy_of_each_index():
    s = StreamState()
    out = s.feed(_d(0, [5, 6], 0, "ab", 1))
    assert [(d.token_ids, d.text) for d in out] == [([5, 6], "ab")]
    assert s.feed(_d(0, [5, 6], 0, "ab", 1)) == []  # read again (live, then from the record)
    out = s.feed(_d(1, [6, 7], 1, "bc", 2, attempt=2))  # overlaps what was yielded: only the new part
    assert [(d.index, d.token_ids, d.offset, d.text) for d in out] == [(2, [7], 2, "c")]
    assert s.feed(_d(5, [9], 7, "z", 4)) == [] and s.gap  # starts past what was yielded: a gap
    out = s.feed(_d(3, [8], 3, "d", 3))
    assert [d.token_ids for d in out] == [[8]] and not s.gap
    out = s.feed(_d(4, [], 4, "", 5, finish="stop"))
    assert out[0].finish_reason == "stop" and s.done
    assert s.feed(_d(4, [1], 4, "x", 6)) == []  # nothing after the end


def test_read_published_folds_the_record_once_per_index():
    def entry(ms, d: Delta, **extra):
        return (f"{ms}-0".encode(), {b"d": codec.pack({**d.to_wire(), **extra})})

    entries = [
        entry(1000, _d(0, [1, 2], 0, "ab", 1), sd=42),
        entry(1001, _d(2, [3], 2, "c", 2)),
        entry(1002, _d(2, [3], 2, "c", 2)),  # a repeat adds nothing
        (b"1003-0", {b"f": b"cancelled"}),  # a terminal event is not output
        entry(1004, _d(3, [4], 3, "d", 3, attempt=2)),
        entry(1005, _d(9, [9], 9, "z", 4)),  # a gap: the fold stops before it
    ]
    p = read_published(entries)
    assert (p.tokens, p.chars, p.seq, p.seed, p.first_token_at) == ([1, 2, 3, 4], 4, 3, 42, 1.0)


def test_a_payload_of_several_samples_feeds_each_lane_and_keeps_a_gap():
    """A job with n > 1 publishes its samples' deltas of one step as one payload (a list): a subscriber
    feeds each to its sample's lane, and a gap in any of them (not only the last) sends it to the record."""
    def sd(sample, index, ids, text):
        return Delta(seq=index + 1, index=index, offset=index, text=text, token_ids=ids, sample=sample)

    s = StreamState()
    payload = codec.pack([sd(0, 0, [5], "a").to_wire(), sd(1, 0, [6], "b").to_wire()])
    out = feed_message(s, payload)
    assert [(d.sample, d.token_ids) for d in out] == [(0, [5]), (1, [6])] and not s.gap
    # sample 0's delta starts past what was yielded; sample 1's is fine: the gap still shows
    out = feed_message(s, codec.pack([sd(0, 3, [7], "c").to_wire(), sd(1, 1, [8], "d").to_wire()]))
    assert [(d.sample, d.token_ids) for d in out] == [(1, [8])] and s.gap
    for bad in (codec.pack([]), codec.pack([1, 2]), codec.pack("x"), b"\xc1"):  # malformed: nothing, no error
        assert feed_message(s, bad) == [] and not s.gap


def test_read_samples_folds_a_payload_of_several_samples():
    def sd(sample, index, ids, **extra):
        return {**Delta(seq=index + 1, index=index, offset=index, text="x" * len(ids), token_ids=ids,
                        sample=sample).to_wire(), **extra}

    entries = [(b"1000-0", {b"d": codec.pack([sd(0, 0, [1], sd=7), sd(1, 0, [2], sd=7)])}),
               (b"1001-0", {b"d": codec.pack([sd(1, 1, [3]), sd(0, 1, [4])])}),
               (b"1002-0", {b"d": codec.pack(sd(1, 2, [5]))}),  # one sample's delta alone
               (b"1003-0", {b"d": codec.pack([{"a": 1}, 3])})]  # malformed: skipped
    got = read_samples(entries)
    assert {k: (p.tokens, p.seed) for k, p in got.items()} == {0: ([1, 4], 7), 1: ([2, 3, 5], 7)}


def _record_token_count(r, job_id) -> int:
    """Token ids published in the job's durable record (its stream, or the record it was compacted
    into), counting every delta (a resend would show)."""
    return sum(len(d.get("i") or []) for payload in read_payloads(r, K, job_id) for d in payload)


def _follow(client, specs):
    jobs = [client.submit(prompt_tokens=p, **kw) for p, kw in specs]
    collectors = [StreamCollector(j, timeout=240) for j in jobs]
    for c in collectors:
        c.start()
    return jobs, collectors


def test_worker_kill9_streams_resume_token_exact(tiny_model, tiny_model_dir, redis_url, tmp_path):
    rng = random.Random(17)
    n_tok = 240  # long by construction: every job is mid-stream when the worker dies
    specs = []
    for i in range(8):
        prompt = [rng.randrange(4, 900) for _ in range(rng.randrange(4, 20))]
        if i < 3:  # greedy
            kw = dict(max_tokens=n_tok, ignore_eos=True)
        elif i < 7:  # seeded sampling: the same tokens with or without a crash
            kw = dict(max_tokens=n_tok, ignore_eos=True, temperature=0.9, top_p=0.95, seed=1000 + i)
        else:  # unseeded sampling: coherent across the crash (no repeat, no gap)
            kw = dict(max_tokens=n_tok, ignore_eos=True, temperature=0.9)
        specs.append((prompt, kw))
    lease = dict(lease_s=2, heartbeat_s=0.5)
    client = Client(redis_url, model="tiny", settings=fast_settings(redis_url, **lease))
    a = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=8, **lease)
    b = None
    try:
        assert wait_registered(redis_url), a.log()
        # the uncrashed reference, computed in this run: each job alone for greedy, an undisturbed run for seeded
        undisturbed = [j.result(timeout=240) for j in (client.submit(prompt_tokens=p, **kw) for p, kw in specs)]
        refs = [reference_tokens(tiny_model, p, n_tok, ignore_eos=True) if i < 3 else undisturbed[i].token_ids
                for i, (p, _) in enumerate(specs)]
        assert all(res.token_ids == ref for res, ref in zip(undisturbed, refs))  # batched == solo

        # every job has streamed 10 entries at the kill
        _, results, b = _kill9_and_resume(client, a, specs, lambda j: client.redis.xlen(K.events(j.id)) >= 10,
                                          lambda: WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=8, **lease))
        for i, res in enumerate(results[:7]):
            assert res.token_ids == refs[i], i  # greedy and seeded: exact across the crash
    finally:
        a.stop()
        if b:
            b.stop()


def test_worker_kill9_mid_speculation_streams_resume_token_exact(tiny_model, tiny_model_dir, redis_url, tmp_path):
    """kill -9 of a worker that speculates at every step (prompt lookup: a step gives a row several
    tokens, one delta), a second one that does too resumes: each stream is the output without
    speculation, token for token, greedy and seeded, each token once."""
    rng = random.Random(29)
    n_tok = 80
    specs = []
    for i in range(3):
        span = [rng.randrange(4, 900) for _ in range(10)]
        kw = dict(max_tokens=n_tok, ignore_eos=True)
        if i >= 1:
            kw.update(temperature=0.9, top_p=0.95, seed=2000 + i)
        specs.append((span * 3 + span[:4], kw))  # repeated spans: lookups find proposals from the start
    refs = [reference_tokens(tiny_model, p, n_tok, ignore_eos=True, speculate="off",
                             sampling={k: v for k, v in kw.items() if k in ("temperature", "top_p", "seed")} or None)
            for p, kw in specs]
    lease = dict(lease_s=2, heartbeat_s=0.5)
    client = Client(redis_url, model="tiny", settings=fast_settings(redis_url, **lease))
    worker = partial(WorkerProc, redis_url, tiny_model_dir, tmp_path, max_batch=8, speculate_always=True, **lease)
    a, b = worker(), None
    try:
        assert wait_registered(redis_url), a.log()
        jobs, results, b = _kill9_and_resume(client, a, specs, lambda j: _record_token_count(client.redis, j.id) >= 10,
                                             worker)
        for i, (job, res) in enumerate(zip(jobs, results)):
            assert res.token_ids == refs[i], i
            # a step's tokens of the job are one delta of its entry
            assert all(len(payload) == 1 for payload in read_payloads(client.redis, K, job.id)), i
        assert sum(res.stats.draft_accepted for res in results) > 0  # the resumed attempts' proposals verified
    finally:
        a.stop()
        if b:
            b.stop()


def _kill9_and_resume(client, a, specs, streamed, start_b):
    """Submit ``specs`` to the frozen worker ``a``, let it run until every job has ``streamed``, kill -9
    it and start ``b`` (``start_b()``); every job then ends resumed on ``b``, its stream each token
    once (the check of both kill -9 tests).  Returns (jobs, results, b)."""
    r = client.redis
    a.freeze()  # while the jobs go in (slow submits would give it time to run them to the end)
    jobs, collectors = _follow(client, specs)
    # frozen once every job has streamed (the worker runs only in short slices meanwhile), so every job
    # is mid-stream at the kill by construction
    assert a.run_until(lambda: all(streamed(j) for j in jobs)), a.log()
    published_at_kill = {j.id: _record_token_count(r, j.id) for j in jobs}
    assert all(j.status() == "running" for j in jobs)
    a.kill9()
    b = start_b()
    results = [j.result(timeout=240) for j in jobs]
    for c in collectors:
        c.join(timeout=60)
    n_tok = specs[0][1]["max_tokens"]
    for i, (job, res, c) in enumerate(zip(jobs, results, collectors)):
        assert c.error is None and not c.is_alive(), (i, c.error)
        assert res.finish_reason == "length" and res.stats.attempts == 2, (i, res)
        assert c.ids == res.token_ids, i  # the stream: each token index once, across the crash
        assert c.text == res.text, i
        assert c.finishes == ["length"], i
        assert _record_token_count(r, job.id) == n_tok, i  # resumed: nothing published twice
        assert 10 <= published_at_kill[job.id] < n_tok, i
    assert b.log().count("resumes after") == len(jobs), b.log()
    return jobs, results, b


def test_publisher_sends_again_what_a_lost_script_cache_refused(redis_url):
    """A Redis restarted without its script cache answers NOSCRIPT: the publisher loads the scripts
    and sends the refused calls again, in order (no SCRIPT EXISTS round trip per step meanwhile)."""
    import threading

    import redis

    from mlxq.shared.protocol import Queue
    from mlxq.shared.settings import Settings
    from mlxq.worker.publisher import Publisher, StepOutput, next_delta_seq

    r = redis.Redis.from_url(redis_url)
    q = Queue(r, K, Settings())
    job = "ab" * 16
    r.hset(K.job(job), "owner", "w:1")
    pub = Publisher(q, threading.Event())
    pub._send([StepOutput(deltas=[(job, "w:1", b"d1", next_delta_seq())])])
    r.script_flush()
    pub._send([StepOutput(deltas=[(job, "w:1", b"d2", next_delta_seq()), (job, "zombie:1", b"dz", next_delta_seq())])])
    assert [f[b"d"] for _, f in r.xrange(K.events(job))] == [b"d1", b"d2"]
    r.close()


def test_a_write_the_client_cannot_send_costs_its_own_step_only(redis_url):
    """A step's writes that fail with what no reconnect cures (here a payload redis-py cannot
    encode, a DataError) are tried alone, and given up: the other steps of the batch still reach
    Redis and the publisher thread lives on (the exception ended it before, and nothing more was
    published while the worker ran on)."""
    import threading

    import redis

    from mlxq.shared.protocol import Queue
    from mlxq.shared.settings import Settings
    from mlxq.worker.publisher import Publisher, StepOutput, next_delta_seq

    r = redis.Redis.from_url(redis_url)
    q = Queue(r, K, Settings())
    good, bad, later = "cd" * 16, "ef" * 16, "01" * 16
    for job in (good, bad, later):
        r.hset(K.job(job), "owner", "w:1")
    stop = threading.Event()
    pub = Publisher(q, stop)
    pub.start()
    try:
        pub.inbox.put(StepOutput(deltas=[(good, "w:1", b"g1", next_delta_seq())]))
        pub.inbox.put(StepOutput(deltas=[(bad, "w:1", {"not": "bytes"}, next_delta_seq())]))
        pub.inbox.put(StepOutput(deltas=[(good, "w:1", b"g2", next_delta_seq())]))
        assert pub.drain(30)
        pub.publish(StepOutput(deltas=[(later, "w:1", b"l1", next_delta_seq())]))
        assert pub.drain(30) and pub.is_alive()
    finally:
        stop.set()
        pub.join(5)
    assert [f[b"d"] for _, f in r.xrange(K.events(good))] == [b"g1", b"g2"]
    assert [f[b"d"] for _, f in r.xrange(K.events(later))] == [b"l1"]
    assert r.xlen(K.events(bad)) == 0
    r.close()


def test_a_clobbered_key_costs_its_own_job_only(redis_url):
    """A job whose events key holds another type (forged or clobbered) has its deltas refused, as a
    lost lease is; the other jobs' deltas of the same script call still land (the WRONGTYPE error
    failed the whole call before, and the step's deltas of every job were dropped). Completing such
    a job still records its result, and a job key that is no hash counts as a lost lease."""
    import threading

    import redis

    from mlxq.shared.protocol import Queue
    from mlxq.shared.settings import Settings
    from mlxq.worker.publisher import Publisher, StepOutput, next_delta_seq

    r = redis.Redis.from_url(redis_url)
    q = Queue(r, K, Settings())
    good, bad, forged = "23" * 16, "45" * 16, "67" * 16
    for job in (good, bad):
        r.hset(K.job(job), "owner", "w:1")
    r.set(K.events(bad), "clobbered")
    r.set(K.job(forged), "not a hash")
    fenced = []
    pub = Publisher(q, threading.Event())
    pub.on_fenced = lambda job, kind, ok: fenced.append((job, kind, ok))
    pub._send([StepOutput(deltas=[(good, "w:1", b"g1", next_delta_seq()), (bad, "w:1", b"b1", next_delta_seq()),
                                  (good, "w:1", b"g2", next_delta_seq())])])
    assert [f[b"d"] for _, f in r.xrange(K.events(good))] == [b"g1", b"g2"]
    assert r.get(K.events(bad)) == b"clobbered"
    pub._send([StepOutput(completions=[(bad, "w:1", "done", b"result", b"final", (1, 1)),
                                       (forged, "w:1", "done", b"result", b"final", (1, 1))])])
    assert r.hget(K.job(bad), "status") == b"done" and r.hget(K.job(bad), "result") == b"result"
    assert fenced == [(bad, "complete", True), (forged, "complete", False)]
    r.close()


def test_a_write_refused_for_now_is_sent_again_not_dropped(redis_url):
    """A reply that only says "not now" (READONLY from a demoted master, MOVED, TRYAGAIN,
    CLUSTERDOWN, LOADING: the call never ran) is sent again, in order, as after a lost link; it was
    logged and dropped before, and that step's deltas were missing from the job's stream."""
    import threading

    import redis

    from mlxq.shared.protocol import Queue
    from mlxq.shared.settings import Settings
    from mlxq.worker.publisher import Publisher, StepOutput, next_delta_seq

    r = redis.Redis.from_url(redis_url)
    q = Queue(r, K, Settings())
    job = "89" * 16
    r.hset(K.job(job), "owner", "w:1")
    refusals = [2]  # the first two round trips are refused
    real_pipeline = r.pipeline

    def pipeline(*a, **kw):
        pipe = real_pipeline(*a, **kw)
        execute = pipe.execute

        def flaky(raise_on_error=True):
            if refusals[0] > 0:
                refusals[0] -= 1
                n = len(pipe.command_stack)
                pipe.reset()
                return [redis.exceptions.ReadOnlyError("You can't write against a read only replica.")] * n
            return execute(raise_on_error=raise_on_error)

        pipe.execute = flaky
        return pipe

    q.redis.pipeline = pipeline
    pub = Publisher(q, threading.Event())
    pub._send([StepOutput(deltas=[(job, "w:1", b"d1", next_delta_seq()), (job, "w:1", b"d2", next_delta_seq())])])
    assert refusals == [0]
    assert [f[b"d"] for _, f in r.xrange(K.events(job))] == [b"d1", b"d2"]
    r.close()


def test_a_record_with_token_ids_outside_the_vocabulary_fails_its_job_alone(tiny_model, redis_url):
    """The tokens an earlier attempt published are prefilled on resume; the record is only as trusted
    as whoever may write it (a producer under the ACL recipe may append to its own job's stream). An
    id outside the vocabulary fails that job with an error that says so; it reached the embedding
    before. The next job runs as usual."""
    import redis

    from workerkit import running_worker

    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    r = redis.Redis.from_url(redis_url)
    forged = client.submit(prompt_tokens=[5, 6, 7], max_tokens=4, ignore_eos=True)
    r.hset(K.job(forged.id), "attempts", 1)  # as if an attempt had run: the next one resumes
    r.xadd(K.events(forged.id), {"d": codec.pack(_d(0, [10**9, 3], 0, "xy").to_wire())})
    with running_worker(tiny_model, redis_url, settings):
        res = forged.result(timeout=60)
        assert res.finish_reason == "error" and "outside the vocabulary" in res.error
        after = client.submit(prompt_tokens=[5, 6, 7], max_tokens=3, ignore_eos=True).result(timeout=60)
        assert after.finish_reason == "length" and after.token_ids == reference_tokens(tiny_model, [5, 6, 7], 3)
    client.close()
    r.close()


class _ReplyLost:
    """A client whose next pipelines run on Redis, then raise as a link lost before the reply came."""

    def __init__(self, redis, losses: int):
        self._redis, self.losses = redis, losses

    def __getattr__(self, name):
        return getattr(self._redis, name)

    def pipeline(self, *args, **kwargs):
        pipe, owner = self._redis.pipeline(*args, **kwargs), self

        class Pipe:
            def __getattr__(self, name):
                return getattr(pipe, name)

            def execute(self, *a, **kw):
                replies = pipe.execute(*a, **kw)
                if owner.losses:
                    owner.losses -= 1
                    raise redis.ConnectionError("connection lost after the write (test)")
                return replies

        return Pipe()


def test_a_step_sent_again_after_its_reply_was_lost_is_written_once(redis_url):
    """The publisher sends a step again when the link fails; when the first send had landed (the
    reply was lost, not the request), its deltas were appended to the stream twice, and a reader of
    the record saw those tokens twice. A delta already written is skipped (deltas.lua, its sequence
    number): the stream and the channel get each delta once, through any number of resends, and the
    same worker's later deltas (a preempted job it leased again, same owner token) still go out."""
    import threading

    from mlxq.shared.protocol import Queue
    from mlxq.shared.settings import Settings
    from mlxq.worker.publisher import Publisher, StepOutput, next_delta_seq

    r = redis.Redis.from_url(redis_url)
    q = Queue(r, K, Settings())
    job, other = "ab" * 16, "cd" * 16
    for j in (job, other):
        r.hset(K.job(j), "owner", "w:1")
    sub = r.pubsub()
    sub.subscribe(K.channel(job))
    assert sub.get_message(timeout=5)["type"] == "subscribe"
    q.load_scripts()  # (as a worker does at start: the sends below land, then lose their replies)
    q.redis = _ReplyLost(r, losses=2)
    pub = Publisher(q, threading.Event())
    pub.backoff.first = pub.backoff.cap = 0.0
    first = StepOutput()
    first.add_delta(job, "w:1", {"s": 1})
    first.add_delta(other, "w:1", {"s": 1})
    first.seal()  # (numbered in the order the steps go out, as Publisher.publish does)
    second = StepOutput(deltas=[(job, "w:1", b"d2", next_delta_seq()), (job, "w:1", b"d3", next_delta_seq())])
    pub._send([first, second])
    assert q.redis.losses == 0  # (sent three times)
    q.redis = r
    pub._send([StepOutput(deltas=[(job, "w:1", b"d4", next_delta_seq())])])
    assert [f[b"d"] for _, f in r.xrange(K.events(job))] == [codec.pack({"s": 1}), b"d2", b"d3", b"d4"]
    assert r.xlen(K.events(other)) == 1
    live = []
    while (m := sub.get_message(timeout=0.5)) is not None:
        live.append(m["data"])
    assert live == [codec.pack({"s": 1}), b"d2", b"d3", b"d4"]
    sub.close()
    r.close()


def test_deltas_a_full_server_refuses_are_sent_again_not_dropped(redis_url):
    """At maxmemory with noeviction, Redis refuses the stream append (OOM). deltas.lua reported that
    as a lost lease and the publisher dropped the step, so the job ran on past a hole in its stream
    that no reader could fill. Now the call fails with the server's error and goes again once the
    server takes writes: the stream holds every delta, once, in order."""
    import threading

    from mlxq.shared.protocol import Queue
    from mlxq.shared.settings import Settings
    from mlxq.worker.publisher import Publisher, StepOutput, next_delta_seq

    r = redis.Redis.from_url(redis_url)
    q = Queue(r, K, Settings())
    job, other = "ef" * 16, "01" * 16
    for j in (job, other):
        r.hset(K.job(j), "owner", "w:1")
    q.load_scripts()
    pub = Publisher(q, threading.Event())
    pub.backoff.first = pub.backoff.cap = 0.01
    gave_up, refused = [], threading.Event()
    pub.loop_inbox = SimpleNamespace(lost=gave_up.extend)
    fail = pub.backoff.fail
    pub.backoff.fail = lambda: (refused.set(), fail())[1]
    pub._send([StepOutput(deltas=[(job, "w:1", b"d1", next_delta_seq())])])
    policy = r.config_get("maxmemory-policy")["maxmemory-policy"]
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", int(r.info("memory")["used_memory"]) - 1000)
    try:
        step = StepOutput(deltas=[(other, "w:1", b"o2", next_delta_seq()), (job, "w:1", b"d2", next_delta_seq())])
        sending = threading.Thread(target=pub._send, args=([step],))
        sending.start()
        assert refused.wait(60)
        assert sending.is_alive() and r.xlen(K.events(job)) == 1
    finally:
        r.config_set("maxmemory", 0)
        r.config_set("maxmemory-policy", policy)
    sending.join(60)
    assert not sending.is_alive() and gave_up == []
    pub._send([StepOutput(deltas=[(job, "w:1", b"d3", next_delta_seq())])])
    assert [f[b"d"] for _, f in r.xrange(K.events(job))] == [b"d1", b"d2", b"d3"]
    assert [f[b"d"] for _, f in r.xrange(K.events(other))] == [b"o2"]
    r.close()


def test_deltas_no_resend_can_write_drop_their_jobs(redis_url):
    """A deltas call that fails for good (an error reply no resend cures) hands its jobs to the worker
    (the MLX loop's inbox, Publisher.loop_inbox), which drops them as on a lost lease: their leases
    lapse and the next attempt resumes from what the stream holds, where before they ran on past the hole."""
    import threading

    from mlxq.shared.protocol import Queue
    from mlxq.shared.settings import Settings
    from mlxq.worker.publisher import Publisher, StepOutput, next_delta_seq

    r = redis.Redis.from_url(redis_url)
    q = Queue(r, K, Settings())
    q.load_scripts()

    class Refusing:
        def __getattr__(self, name):
            return getattr(r, name)

        def pipeline(self, *args, **kwargs):
            pipe = r.pipeline(*args, **kwargs)

            class Pipe:
                def __getattr__(self, name):
                    return getattr(pipe, name)

                def execute(self, *a, **kw):
                    return [redis.ResponseError("ERR refused for good (test)") for _ in pipe.execute(*a, **kw)]

            return Pipe()

    q.redis = Refusing()
    pub = Publisher(q, threading.Event())
    gave_up = []
    pub.loop_inbox = SimpleNamespace(lost=gave_up.extend)
    pub._send([StepOutput(deltas=[("ab" * 16, "w:3", b"x", next_delta_seq()), ("cd" * 16, "w:1", b"y", next_delta_seq()),
                                  ("ab" * 16, "w:3", b"z", next_delta_seq())])])
    assert gave_up == [("ab" * 16, "w:3"), ("cd" * 16, "w:1")]
    r.close()


def test_a_stream_its_producer_broke_costs_only_its_own_job(redis_url):
    """A producer may write its own job's stream: an entry at the last possible id makes every later
    append fail. That job's deltas are refused (and the job handed back to the worker to drop); the
    other jobs of the same call are written. Before, any append error but WRONGTYPE failed the whole
    call and dropped every job in it."""
    import threading

    from mlxq.shared.protocol import Queue
    from mlxq.shared.settings import Settings
    from mlxq.worker.publisher import Publisher, StepOutput, next_delta_seq

    r = redis.Redis.from_url(redis_url)
    q = Queue(r, K, Settings())
    broken, fine = "a1" * 16, "b2" * 16
    for j in (broken, fine):
        r.hset(K.job(j), "owner", "w:1")
    r.xadd(K.events(broken), {"d": "x"}, id="18446744073709551615-18446744073709551615")
    q.load_scripts()
    pub = Publisher(q, threading.Event())
    gave_up = []
    pub.loop_inbox = SimpleNamespace(lost=gave_up.extend)
    pub._send([StepOutput(deltas=[(broken, "w:1", b"x1", next_delta_seq()), (fine, "w:1", b"f1", next_delta_seq())])])
    assert gave_up == [(broken, "w:1")]
    assert [f[b"d"] for _, f in r.xrange(K.events(fine))] == [b"f1"]
    r.close()
