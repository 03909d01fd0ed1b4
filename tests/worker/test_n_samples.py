"""``n`` > 1: one job, n samples of one prompt, end to end.

A real Valkey, the real worker (on a thread, and as killed subprocesses for the crash), the Python
client and the real gateway with the official ``openai`` client.  No generated text is hard-coded:
greedy samples are compared with the greedy answer of this run's model alone (refkit), sampled ones
with another run of the same seeded job in this test."""

from __future__ import annotations

import json
from collections import defaultdict

import openai
import pytest
import redis

from mlxq import Client
from mlxq.producer.gateway import ServerThread, create_app
from mlxq.shared import codec
from mlxq.shared.embedded import EmbeddedRedis
from mlxq.shared.keys import GlobalKeys, ModelKeys
from mlxq.shared.replay import read_payloads
from mlxq.shared.schemas import MAX_N, GenerateRequest
from faultkit import WorkerProc, wait_registered
from refkit import greedy
from workerkit import fast_settings, running_worker, wait_for

GK = GlobalKeys()
PROMPT = "Once upon a time"
SEEDED = dict(temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(tiny_model):
    """(worker, client, gateway url) serving "tiny" for the whole module, on a Valkey of its own (the
    tests that start their own workers use the session's: no worker of this one takes their jobs)."""
    server = EmbeddedRedis().start()
    r = redis.Redis.from_url(server.url)
    settings = fast_settings(server.url)
    try:
        with running_worker(tiny_model, server.url, settings, max_batch=8) as worker:
            assert wait_for(lambda: r.hexists(GK.models, "tiny"), timeout=60)
            client = Client(server.url, model="tiny", settings=settings)
            with ServerThread(create_app(server.url, settings)) as url:
                yield worker, client, url
            client.close()
    finally:
        r.close()
        server.stop()


def by_sample(deltas) -> dict[int, tuple[list[int], str, list[str]]]:
    """A stream's deltas per sample: (token ids, text, finish reasons), each as yielded."""
    out: dict[int, tuple[list[int], str, list[str]]] = defaultdict(lambda: ([], "", []))
    for d in deltas:
        ids, text, fins = out[d.sample or 0]
        out[d.sample or 0] = (ids + d.token_ids, text + d.text, fins + ([d.finish_reason] if d.finish_reason else []))
    return dict(out)


def outputs(res) -> list[tuple[list[int], str]]:
    return [(o.token_ids, o.text) for o in res.outputs]


def test_bad_n_is_refused_before_queueing(redis_url):
    client = Client(redis_url, model="tiny", settings=fast_settings(redis_url))
    for bad in (0, MAX_N + 1, "2", 2.0):
        with pytest.raises(ValueError, match="n"):
            client.submit(PROMPT, n=bad, max_tokens=4)
    with pytest.raises(ValueError, match="session_id"):
        client.submit(PROMPT, n=2, session_id="chat-1")
    assert client.redis.zcard(ModelKeys("tiny").queue) == 0  # nothing was queued
    client.close()


def test_greedy_samples_each_equal_the_solo_answer_and_the_stream_equals_the_result(stack, tiny_model):
    _, client, _ = stack
    ref_ids, ref_text = greedy(tiny_model, PROMPT, 24)
    job = client.submit(PROMPT, n=3, max_tokens=24)
    streamed = by_sample(job.stream(timeout=120))
    res = job.result(timeout=60)
    assert [o.index for o in res.outputs] == [0, 1, 2]
    assert outputs(res) == [(ref_ids, ref_text)] * 3
    assert (res.token_ids, res.text, res.finish_reason) == (ref_ids, ref_text, res.samples[0].finish_reason)
    # the stream: each sample's tokens and text once, in order, ended once with the result's reason
    assert sorted(streamed) == [0, 1, 2]
    for o in res.outputs:
        assert streamed[o.index] == (o.token_ids, o.text, [o.finish_reason])
    assert res.usage.completion_tokens == 3 * len(ref_ids)


def test_a_steps_samples_are_one_entry_of_the_record(stack):
    """The samples of a job with n > 1 decode together: the deltas they make in one step are one
    stream entry (and one pub/sub message, the same payload) holding each sample's delta, not n
    entries; the record still holds each sample's tokens exactly once."""
    _, client, _ = stack
    job = client.submit(PROMPT, n=4, max_tokens=16, temperature=0.9, seed=5)
    res = job.result(timeout=120)
    entries = read_payloads(client.redis, ModelKeys("tiny"), job.id)
    assert all(len({d["x"] for d in e}) == len(e) for e in entries)  # one delta per sample an entry
    assert max(len(e) for e in entries) > 1 and len(entries) < sum(len(e) for e in entries)
    assert _record_by_sample(client.redis, job.id) == {o.index: o.token_ids for o in res.outputs}


def test_seeded_samples_are_reproducible_in_any_batch(stack):
    _, client, _ = stack
    alone = client.submit(PROMPT, n=4, max_tokens=20, **SEEDED).result(timeout=120)
    # the same job again, now in a batch with other jobs
    others = [client.submit(PROMPT + " x" * i, max_tokens=30, **SEEDED) for i in range(3)]
    again = client.submit(PROMPT, n=4, max_tokens=20, **SEEDED)
    assert outputs(again.result(timeout=120)) == outputs(alone)
    solo = client.submit(PROMPT, max_tokens=20, **SEEDED).result(timeout=120)
    assert outputs(solo) == outputs(alone)[:1]  # sample 0 draws the keys of an n == 1 job
    for j in others:
        j.result(timeout=120)


def test_sample_draws_differ_and_sample_0_keeps_todays_draws():
    from mlxq.worker.engine.sampler import step_uniform

    draws = [step_uniform(7, 3, sample=i) for i in range(4)]
    assert len(set(draws)) == 4
    assert draws[0] == step_uniform(7, 3)
    assert all(0.0 <= u < 1.0 for u in draws)


def test_constrained_samples_each_follow_the_constraint(stack):
    _, client, _ = stack
    choices = ["yes", "no", "maybe"]
    res = client.submit(PROMPT, n=3, max_tokens=8, temperature=1.0, seed=5,
                        response_format={"type": "choice", "choices": choices}).result(timeout=120)
    assert len(res.outputs) == 3
    assert all(o.text in choices and o.finish_reason == "stop" for o in res.outputs)


def test_cancel_ends_every_sample_and_frees_their_blocks(stack):
    worker, client, _ = stack
    job = client.submit(PROMPT, n=4, max_tokens=4000, ignore_eos=True)  # long by construction
    seen: set[int] = set()
    for d in job.stream(timeout=120):
        if d.token_ids:
            seen.add(d.sample)
        if len(seen) == 4:
            break
    assert worker.engine.stats()["blocks_used"] > 0
    job.cancel()
    res = job.result(timeout=60)
    assert res.finish_reason == "cancelled"
    assert [o.finish_reason for o in res.outputs] == ["cancelled"] * 4
    assert wait_for(lambda: not worker.active and worker.engine.stats()["blocks_used"] == 0, timeout=30)


def test_openai_client_n_2_chat_and_completions(stack):
    _, _, url = stack
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "hello there"}]
    resp = oai.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=8, seed=3, temperature=0.9)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == resp.model_extra["stats"]["generated_tokens"]
    # streaming: the library reassembles each choice from chunks carrying its index
    text, finish = defaultdict(str), {}
    for chunk in oai.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=8, seed=3,
                                             temperature=0.9, stream=True):
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [text[i] for i in (0, 1)] == [c.message.content for c in resp.choices]
    assert [finish[i] for i in (0, 1)] == [c.finish_reason for c in resp.choices]
    comp = oai.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=6)
    ref = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
    assert [c.text for c in comp.choices] == [ref.choices[0].text] * 2  # greedy: each as the n == 1 answer


@pytest.mark.parametrize("n", [0, MAX_N + 1, "2"])
def test_gateway_refuses_a_bad_n(stack, n):
    _, _, url = stack
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra_body={"n": n})
    assert exc.value.body["param"] == "n"


def _record_by_sample(r, job_id) -> dict[int, list[int]]:
    """Every token id the job's durable record holds per sample, counting every delta (a resend shows)."""
    out: dict[int, list[int]] = defaultdict(list)
    for payload in read_payloads(r, ModelKeys("tiny"), job_id):  # its stream, or its compacted record
        for d in payload:  # one delta, or several samples' of a step
            out[d.get("x", 0)] += d.get("i", [])
    return out


def test_kill9_mid_stream_resumes_every_sample_exactly(redis_url, tiny_model_dir, tmp_path):
    lease = dict(lease_s=2, heartbeat_s=0.5)
    client = Client(redis_url, model="tiny", settings=fast_settings(redis_url, **lease))
    a = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=8, **lease)
    b = None
    try:
        assert wait_registered(redis_url), a.log()
        spec = dict(prompt=PROMPT, n=4, max_tokens=400, **SEEDED)  # long by construction
        ref = client.submit(**spec).result(timeout=120)  # the uncrashed run
        job = client.submit(**spec)
        assert a.run_until(lambda: len(_record_by_sample(client.redis, job.id)) == 4, slice_s=0.005), a.log()
        assert job.status() == "running"  # frozen mid-stream: every sample has published some of its tokens
        a.kill9()
        b = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=8, **lease)
        streamed = by_sample(job.stream(timeout=120))
        res = job.result(timeout=120)
        assert res.stats.attempts == 2, a.log() + "\n-----\n" + b.log()
        assert outputs(res) == outputs(ref)
        for o in res.outputs:
            assert streamed[o.index] == (o.token_ids, o.text, [o.finish_reason])
        record = _record_by_sample(client.redis, job.id)  # nothing published twice, nothing missing
        assert [record[o.index] for o in res.outputs] == [o.token_ids for o in res.outputs]
    finally:
        a.stop()
        if b is not None:
            b.stop()
        client.close()


def test_a_sample_that_ended_before_a_crash_is_kept_from_the_record(tiny_model):
    """read_samples folds each sample apart and keeps the end of one that finished; the next attempt
    runs only the samples that had not ended, each after its own last token."""
    from mlxq.shared.protocol import Pulled
    from mlxq.shared.schemas import Delta
    from mlxq.worker.jobs import read_samples, start_job

    def entry(ms, **kw):
        return (f"{ms}-0".encode(), {b"d": codec.pack(Delta(**kw).to_wire())})

    entries = [entry(1, sample=0, seq=1, index=0, offset=0, text="a", token_ids=[1]),
               entry(2, sample=1, seq=1, index=0, offset=0, text="b", token_ids=[2]),
               entry(3, sample=1, seq=2, index=1, offset=1, text="", token_ids=[], finish_reason="stop",
                     n_samples=2),
               entry(4, sample=0, seq=2, index=1, offset=1, text="c", token_ids=[3])]
    p = read_samples(entries)
    assert (p[0].tokens, p[0].finish, p[1].tokens, p[1].finish) == ([1, 3], None, [2], "stop")
    req = GenerateRequest(model="tiny", prompt=PROMPT, n=2, max_tokens=8)
    pulled = Pulled(job_id=req.id, kind="job", raw_request=b"", attempt=2, tier="normal", score=0.0,
                    queued_at=0.0, resume=b"", now=0.0)
    prompt = tiny_model.tokenizer.encode(PROMPT)
    samples = start_job(pulled, req, prompt, tiny_model.tokenizer, "w", 0.0, p)
    assert [(s.uid, s.tokens, s.seq) for s in samples] == [(f"{req.id}#0", [1, 3], 2)]
    ended = samples[0].group.outputs[1]
    assert (ended.token_ids, ended.finish_reason, ended.text) == ([2], "stop", tiny_model.tokenizer.decode([2]))
    spec = samples[0].spec(tiny_model.eos_token_ids)
    assert (spec.fork_of, spec.resume_tokens, spec.max_tokens) == (None, [1, 3], 6)
    assert GenerateRequest(model="m", prompt="x").n == 1
    assert "x" not in Delta(text="t").to_wire()  # an n == 1 job's wire format is unchanged


def test_preempted_samples_resume_exactly_in_a_small_pool(tiny_model, redis_url):
    """Four samples that cannot all fit the pool at full length: the engine preempts some; each waits
    for memory again and resumes after its last token (greedy: each is the solo answer)."""
    import random

    from faultkit import reference_tokens
    from mlxq.worker.engine import PagedEngine

    prompt = [random.Random(3).randrange(4, 900) for _ in range(40)]
    ref = reference_tokens(tiny_model, prompt, 150, ignore_eos=True)
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    # speculation off: the test needs the preemption a one-token-a-step schedule gives
    engine = PagedEngine(tiny_model.model, num_blocks=14, eos_token_ids=tiny_model.eos_token_ids, model_id="tiny",
                         speculate="off")
    with running_worker(tiny_model, redis_url, settings, engine=engine) as w:
        job = client.submit(prompt_tokens=prompt, n=4, max_tokens=150, ignore_eos=True)
        streamed = by_sample(job.stream(timeout=120))
        res = job.result(timeout=60)
        assert wait_for(lambda: not w.active and w.engine.stats()["blocks_used"] == 0, timeout=30)
        stats = w.engine.stats()
    assert stats["preemptions"] > 0
    assert outputs(res) == [(ref, tiny_model.tokenizer.decode(ref))] * 4
    for o in res.outputs:
        assert streamed[o.index] == (o.token_ids, o.text, [o.finish_reason])
    client.close()


def test_async_client_map_cli_and_batch_lines_take_n(stack, capsys):
    import asyncio

    from mlxq import AsyncClient
    from mlxq.cli import main
    from mlxq.producer.bulk import batch_line

    worker, client, _ = stack
    url = worker.settings.redis_url

    async def run_async():
        ac = AsyncClient(url, model="tiny", settings=worker.settings)
        try:
            job = await ac.submit(PROMPT, n=2, max_tokens=6)
            streamed = by_sample([d async for d in job.stream(timeout=60)])
            return streamed, await job.result(timeout=60)
        finally:
            await ac.aclose()

    streamed, res = asyncio.run(run_async())
    assert [streamed[o.index] for o in res.outputs] == [(o.token_ids, o.text, [o.finish_reason]) for o in res.outputs]
    mapped = list(client.map([{"prompt": PROMPT, "max_tokens": 6}], n=2, timeout=60))
    assert outputs(mapped[0]) == outputs(res)  # greedy: the same samples by either client
    line = batch_line(1, "c1", res.id, "tiny", False, res)
    assert [c["text"] for c in line["response"]["body"]["choices"]] == [o.text for o in res.outputs]
    assert main(["submit", PROMPT, "--n", "2", "--max-tokens", "6", "--model", "tiny", "--redis-url", url]) == 0
    out = capsys.readouterr().out
    assert all(f"--- sample {o.index} ({o.finish_reason}) ---\n{o.text}\n" in out for o in res.outputs)
