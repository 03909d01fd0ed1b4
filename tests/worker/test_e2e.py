"""End to end on a real Valkey server: producers -> Redis -> one MLX worker -> streams and results."""

from __future__ import annotations

import random
import threading

import pytest

from mlxq import AuthError, Client
from mlxq.shared import apikeys
from mlxq.shared.keys import GlobalKeys, ModelKeys
from workerkit import fast_settings, running_worker, tier_clients, wait_for
from faultkit import reference_tokens

K = ModelKeys("tiny")


def streamed_text(tokenizer, ids):
    """The text of these tokens as OpenAI and vLLM return it: exactly ``decode(ids)`` (a leading
    space kept; mlx-lm's streaming detokenizer would trim it)."""
    return tokenizer.decode(ids)


def collect(job, sink, key):
    text, ids, finishes = "", [], []
    for d in job.stream(timeout=120):
        text += d.text
        ids += d.token_ids
        if d.finish_reason:
            finishes.append(d.finish_reason)
    sink[key] = (text, ids, finishes)


def make_engine(loaded):
    from mlxq.worker.engine import PagedEngine

    # a small pool: admission control and preemption really happen
    return PagedEngine(loaded.model, num_blocks=14, eos_token_ids=loaded.eos_token_ids, model_id=loaded.name)


def test_greedy_matches_solo_with_joins_leaves_and_cancels(tiny_model, redis_url):
    rng = random.Random(7)
    vocab = 1000
    specs = []
    for i in range(24):
        prompt = [rng.randrange(4, min(vocab, 900)) for _ in range(rng.randrange(2, 90))]
        specs.append((prompt, rng.randrange(20, 90)))
    shared = [rng.randrange(4, 900) for _ in range(70)]
    specs[1] = (shared, specs[1][1])
    specs[5] = (shared + specs[5][0], specs[5][1])  # shares two full blocks with job 1 (paged: a hit)
    # long outputs in a 14-block pool, so running sequences get preempted and resumed
    long_run = True
    refs = [reference_tokens(tiny_model, p, n, ignore_eos=long_run) for p, n in specs]
    cancel_at = {3, 11, 17}
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    streamed: dict = {}
    with running_worker(tiny_model, redis_url, settings, max_batch=6,
                        engine=make_engine(tiny_model)) as w:
        jobs, threads = [], []
        for i, (prompt, n) in enumerate(specs):
            job = client.submit(prompt_tokens=prompt, max_tokens=n, ignore_eos=long_run)
            jobs.append(job)
            t = threading.Thread(target=collect, args=(job, streamed, i))
            t.start()
            threads.append(t)
            if i in cancel_at:
                # cancel once it has streamed something (it may also finish first: checked below)
                wait_for(lambda: client.redis.xlen(K.events(job.id)) > 0, timeout=120)
                job.cancel()
        for t in threads:
            t.join(timeout=120)
        results = [j.result(timeout=60) for j in jobs]
        assert wait_for(lambda: w.engine.has_work() is False and not w.active, timeout=60)
        engine_stats = w.engine.stats()
    print(engine_stats)  # (prefix hits are arranged deterministically in their own test)
    assert engine_stats["blocks_used"] == 0  # nothing leaked
    for i, (res, ref) in enumerate(zip(results, refs)):
        text, ids, finishes = streamed[i]
        assert finishes == [res.finish_reason], i
        assert ids == res.token_ids, i  # streamed == final, nothing lost, duplicated or reordered
        assert text == res.text, i
        if res.finish_reason == "cancelled":
            assert i in cancel_at
            assert res.token_ids == ref[: len(res.token_ids)], i
        else:
            assert res.token_ids == ref, i
            assert res.finish_reason == ("length" if len(ref) == specs[i][1] else "stop")
            if not long_run:
                assert res.text == streamed_text(tiny_model.tokenizer, ref)


def test_paged_preemption_requeues_through_redis_and_resumes_exactly(tiny_model, redis_url):
    from mlxq.worker.engine import PagedEngine

    rng = random.Random(3)
    prompts = [[rng.randrange(4, 900) for _ in range(40)] for _ in range(4)]
    refs = [reference_tokens(tiny_model, p, 150, ignore_eos=True) for p in prompts]
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    streamed: dict = {}
    engine = PagedEngine(tiny_model.model, num_blocks=14, eos_token_ids=tiny_model.eos_token_ids, model_id="tiny")
    with running_worker(tiny_model, redis_url, settings, engine=engine) as w:
        jobs = [client.submit(prompt_tokens=p, max_tokens=150, ignore_eos=True) for p in prompts]
        threads = [threading.Thread(target=collect, args=(j, streamed, i)) for i, j in enumerate(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        results = [j.result(timeout=60) for j in jobs]
        stats = w.engine.stats()
    assert stats["preemptions"] > 0 and stats["blocks_used"] == 0
    assert client.queue_for("tiny").counts().get("requeued", 0) == stats["preemptions"]
    for i, (res, ref) in enumerate(zip(results, refs)):
        text, ids, _ = streamed[i]
        assert res.token_ids == ref, i  # exactly what it would have been
        assert ids == ref and text == res.text, i  # nothing streamed twice across the requeue


def test_paged_prefix_hit_is_exact(tiny_model, redis_url):
    """A prefix hit arranged by construction: the first job's full blocks are cached when it ends,
    nothing else runs, and the pool is large enough that nothing is evicted before the second."""
    from mlxq.worker.engine import PagedEngine

    rng = random.Random(5)
    shared = [rng.randrange(4, 900) for _ in range(70)]  # two full 32-token blocks and a tail
    prompts = [shared + [rng.randrange(4, 900) for _ in range(9)], shared + [rng.randrange(4, 900) for _ in range(5)]]
    refs = [reference_tokens(tiny_model, p, 20, ignore_eos=True) for p in prompts]
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    engine = PagedEngine(tiny_model.model, num_blocks=64, eos_token_ids=tiny_model.eos_token_ids, model_id="tiny")
    with running_worker(tiny_model, redis_url, settings, engine=engine) as w:
        first = client.submit(prompt_tokens=prompts[0], max_tokens=20, ignore_eos=True).result(timeout=120)
        hits_before = w.engine.stats()["prefix_hit_tokens"]
        second = client.submit(prompt_tokens=prompts[1], max_tokens=20, ignore_eos=True).result(timeout=120)
        assert wait_for(lambda: not w.engine.has_work() and not w.active, timeout=60)
        stats = w.engine.stats()
    assert hits_before == 0
    assert stats["prefix_hit_tokens"] == 64  # the two shared full blocks
    assert [first.token_ids, second.token_ids] == refs
    assert stats["blocks_used"] == 0


def test_per_request_params_and_seeded_reproducibility_in_a_batch(tiny_model, redis_url):
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    prompt = "The ship sailed across the sea"
    with running_worker(tiny_model, redis_url, settings, max_batch=8):
        # 24 tokens each whatever the weights (ignore_eos): the outputs compared below cannot all be
        # an early EOS
        alone = client.submit(prompt, max_tokens=24, temperature=0.9, seed=1234, ignore_eos=True).result(timeout=60)
        batch = [
            client.submit(prompt, max_tokens=24, temperature=0.9, seed=1234, ignore_eos=True),
            client.submit(prompt, max_tokens=24, ignore_eos=True),  # greedy
            client.submit(prompt, max_tokens=24, temperature=1.5, top_k=20, seed=5, ignore_eos=True),
            client.submit("Another prompt entirely", max_tokens=30, temperature=0.7, top_p=0.8, seed=9),
            client.submit(prompt, max_tokens=24, temperature=0.9, seed=1234, repetition_penalty=1.3,
                          ignore_eos=True),
        ]
        res = [j.result(timeout=60) for j in batch]
    ids = tiny_model.tokenizer.encode(prompt)
    greedy_ref = reference_tokens(tiny_model, ids, 24, ignore_eos=True)
    assert res[0].token_ids == alone.token_ids  # same seed: same tokens alone or in a batch
    assert res[1].token_ids == greedy_ref
    # each job's own params, against mlx-lm's single-sequence forward with that job's sampler and
    # processors (whatever the weights; a sampler's key of token n is hash(seed, n))
    assert res[0].token_ids == _sampled_ref(tiny_model, ids, 24, temperature=0.9, seed=1234)
    assert res[2].token_ids == _sampled_ref(tiny_model, ids, 24, temperature=1.5, top_k=20, seed=5)
    assert res[4].token_ids == _sampled_ref(tiny_model, ids, 24, temperature=0.9, seed=1234,
                                            repetition_penalty=1.3)


def _sampled_ref(loaded, prompt_ids, n, **params):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlxq.shared.schemas import SamplingParams
    from mlxq.worker.engine.sampler import make_sampler
    from refkit import reference_processors

    p = SamplingParams(max_tokens=n, ignore_eos=True, **params)
    steps = generate_step(mx.array(prompt_ids), loaded.model, max_tokens=n, sampler=make_sampler(p, p.seed),
                          logits_processors=reference_processors(p))
    return [int(t) for t, _ in steps]


def test_priority_order_through_a_busy_worker(tiny_model, redis_url):
    settings = fast_settings(redis_url)
    admin, low, high = tier_clients(redis_url, settings, "0001")
    with running_worker(tiny_model, redis_url, settings, max_batch=1):
        # the blocker holds the only slot until it is cancelled: long by construction
        blocker = admin.submit("warm up", max_tokens=3000, ignore_eos=True)
        next(iter(blocker.stream(timeout=120)))  # it is running: its first delta arrived
        lows = [low.submit("low job", max_tokens=3) for _ in range(3)]
        normal = admin.submit("normal job", max_tokens=3)
        hi = high.submit("high job", max_tokens=3)
        blocker.cancel()
        results = {j.id: j.result(timeout=120) for j in [blocker, *lows, normal, hi]}
    assert results[blocker.id].finish_reason == "cancelled"
    # (the high job may also preempt the blocker, which then waits in the queue again and is cancelled
    # there, with no start time in its result: leave it out)
    order = sorted((k for k in results if k != blocker.id), key=lambda k: results[k].stats.started_at)
    assert order[:2] == [hi.id, normal.id] and set(order[2:]) == {j.id for j in lows}
    assert results[hi.id].stats.tier == "high" and results[lows[0].id].stats.tier == "low"
    with pytest.raises(AuthError):
        Client(redis_url, api_key="no-such-key-123", model="tiny", settings=settings).submit("x")
    apikeys.revoke_key(admin.redis, GlobalKeys().api_keys, "key-low-00001")
    with pytest.raises(AuthError):
        low.submit("x")


def test_cancel_queued_and_running_jobs(tiny_model, redis_url):
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    queued = client.submit("never runs", max_tokens=5)
    assert queued.cancel() == "cancelled"
    assert queued.result(timeout=5).finish_reason == "cancelled"
    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        # long by construction: it runs to the model's context limit unless cancelled
        running = client.submit("a long story", max_tokens=tiny_model.context_length - 16, ignore_eos=True)
        seen = []
        for d in running.stream(timeout=60):
            seen.append(d)
            if len(seen) == 3:
                assert running.cancel() == "cancelling"
        res = running.result(timeout=30)
        other = client.submit("still works", max_tokens=4).result(timeout=30)
    assert res.finish_reason == "cancelled" and 3 <= len(res.token_ids) < tiny_model.context_length - 16
    assert seen[-1].finish_reason == "cancelled"
    assert other.finish_reason in ("length", "stop")


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_with_stop(tiny_model, redis_url):
    """The token that reaches max_tokens also completes a stop string: the reason is "stop" (as vLLM's)."""
    tok = tiny_model.tokenizer
    case = None
    for seed in range(20):  # a prompt whose 4th token adds text that a stop string can end on
        rng = random.Random(seed)
        prompt = [rng.randrange(4, 900) for _ in range(6)]
        ids = reference_tokens(tiny_model, prompt, 4, ignore_eos=True)
        t3, t4 = tok.decode(ids[:3]), tok.decode(ids[:4])
        if not t4.startswith(t3) or len(t4) == len(t3):
            continue
        stop = next((t4[-m:] for m in range(1, len(t4) + 1) if t4[-m:] not in t3), None)
        if stop is not None and t4.index(stop) == len(t4) - len(stop):
            case = prompt, stop, t4[:-len(stop)]
            break
    assert case, "no prompt of 20 gave a fourth token with text"
    prompt, stop, expected = case
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    with running_worker(tiny_model, redis_url, settings):
        res = client.submit(prompt_tokens=prompt, max_tokens=4, ignore_eos=True, stop=[stop]).result(timeout=60)
    assert (res.finish_reason, res.text) == ("stop", expected)


def test_late_subscriber_gets_the_whole_text(tiny_model, redis_url):
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    with running_worker(tiny_model, redis_url, settings):
        job = client.submit("Once upon a time", max_tokens=20, ignore_eos=True)  # 20 tokens, whatever the weights
        res = job.result(timeout=60)
    late = Client(redis_url, model="tiny", settings=settings).job(job.id)
    deltas = list(late.stream(timeout=10))
    assert "".join(d.text for d in deltas) == res.text
    assert sum((d.token_ids for d in deltas), []) == res.token_ids
    assert deltas[-1].finish_reason == res.finish_reason


def test_stats_counts_are_exact(tiny_model, redis_url):
    from mlxq.producer import stats

    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    c = client.submit("cancel me", max_tokens=5)
    c.cancel()
    with running_worker(tiny_model, redis_url, settings) as w:
        done = [client.submit(f"job {i}", max_tokens=4) for i in range(5)]
        # a job only the worker can refuse: longer than the context, though not by the producer's lower
        # bound (bytes / the longest token's bytes); ids outside the vocabulary are refused at submit
        ctx = tiny_model.context_length
        too_long = " ".join(str(i % 10) for i in range(ctx + 8))
        assert len(tiny_model.tokenizer.encode(too_long)) > ctx
        bad = client.submit(too_long, max_tokens=4)
        for j in done + [bad]:
            j.result(timeout=60)
        assert wait_for(lambda: w.stats.snapshot.get("processed", {}).get("done") == 5, timeout=60)

        def published():
            ws = stats.collect(client.redis)["tiny"]["workers"]
            return ws and ws[0]["processed"]["done"] == 5

        assert wait_for(published, timeout=60)
        s = stats.collect(client.redis)["tiny"]
    assert (s["submitted"], s["done"], s["failed"], s["cancelled"], s["processed"]) == (7, 5, 1, 1, 7)
    assert s["queued"] == {"high": 0, "normal": 0, "low": 0} and s["running"] == 0
    assert s["active_by_tier"] == {"high": 0, "normal": 0, "low": 0}
    assert s["workers"][0]["tokens_generated"] >= 5
    assert s["peak_memory_bytes"] > 0
    assert "processed 7" in stats.render({"tiny": s})


def test_bad_input_is_refused_and_the_worker_survives(tiny_model, redis_url):
    from mlxq.shared import codec
    from mlxq.shared.keys import ModelKeys
    from mlxq.shared.protocol import Queue

    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    for kwargs in [dict(prompt="x", temperature=-1), dict(prompt="x", max_tokens=0), dict(prompt="x", top_p=2),
                   dict(), dict(prompt="x", prompt_tokens=[1]), dict(prompt="x", stop=[""]),
                   dict(prompt="x", bogus=1)]:
        with pytest.raises(ValueError):
            client.submit(**kwargs)
    q = Queue(client.redis, ModelKeys("tiny"), settings)
    q.enqueue("a" * 32, b"\xc1\xff not msgpack", global_redis=client.redis)  # anonymous: normal
    q.enqueue("b" * 32, codec.pack({"model": "tiny", "prompt": 5}), global_redis=client.redis)  # anonymous: normal
    q.enqueue("c" * 32, codec.pack([1, 2, 3]), global_redis=client.redis)  # anonymous: normal
    client.redis.zadd(q.keys.queue, {"garbage-member": 0})
    too_long = client.submit(prompt_tokens=[5] * (tiny_model.context_length + 10), max_tokens=2)
    with running_worker(tiny_model, redis_url, settings):
        good = client.submit("still alive", max_tokens=5).result(timeout=60)
        assert wait_for(lambda: all(client.job(i).status() == "failed" for i in ("a" * 32, "b" * 32, "c" * 32)),
                        timeout=60)
    assert good.finish_reason in ("length", "stop")
    res = too_long.result(timeout=10)
    assert res.finish_reason == "error" and "context" in res.error
    for i in ("a" * 32, "b" * 32, "c" * 32):
        r = client.job(i).result(timeout=5)
        assert r.finish_reason == "error" and ("malformed" in r.error or "invalid" in r.error)
    assert client.redis.zscore(q.keys.dead, "garbage-member") is not None


def test_result_while_another_thread_streams_the_same_job(tiny_model, redis_url):
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    with running_worker(tiny_model, redis_url, settings):
        job = client.submit("Once upon a time", max_tokens=40, ignore_eos=True)
        sink: dict = {}
        t = threading.Thread(target=collect, args=(job, sink, 0))
        t.start()
        res = job.result(timeout=60)  # must not pull the subscription out from under stream()
        t.join(timeout=60)
    text, ids, finishes = sink[0]
    assert ids == res.token_ids and text == res.text and finishes == ["length"]


def test_usage_reports_prefix_cache_hits_per_job(tiny_model, redis_url):
    """Result.usage.cached_tokens: the prompt tokens whose KV the paged engine found in its prefix cache."""
    from mlxq.worker.engine import PagedEngine

    prompt = [random.Random(5).randrange(4, 900) for _ in range(70)]
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    engine = PagedEngine(tiny_model.model, num_blocks=32, eos_token_ids=tiny_model.eos_token_ids, model_id="tiny")
    with running_worker(tiny_model, redis_url, settings, engine=engine):
        first = client.submit(prompt_tokens=prompt, max_tokens=2, ignore_eos=True).result(timeout=60)
        second = client.submit(prompt_tokens=prompt, max_tokens=2, ignore_eos=True).result(timeout=60)
    assert first.usage.cached_tokens == 0 and first.usage.prompt_tokens == 70
    assert second.usage.cached_tokens == 64  # two full 32-token blocks; the last partial one is computed
    assert second.usage.completion_tokens == 2 and second.usage.total_tokens == 72
