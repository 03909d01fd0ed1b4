"""A job's time limit, ``timeout_s`` (as rq's job_timeout: execution time): past it the job ends with
finish reason "timeout" and its tokens so far, which are a prefix of the same request's answer
without a limit; the gateway shows it as OpenAI's "length" with ``mlxq_finish_reason`` "timeout"; a
bad value is refused at submit. No assertion depends on how fast the worker runs: the worker's
MLX thread is held between two steps once the job has a few tokens, the job's deadline is moved to
now (as if its time had passed), and then the step goes on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from collections import Counter

import openai
import pytest

from mlxq import Client
from mlxq.producer.gateway import ServerThread, create_app
from workerkit import fast_settings, running_worker, wait_for
from faultkit import StreamCollector, reference_tokens

PROMPT = [5, 17, 99, 230, 41]
MAX_TOKENS = 300


@contextlib.contextmanager
def held_then_due(worker, n: int = 5):
    """Hold the worker's MLX thread at the first step after which a job with a ``timeout_s`` has ``n``
    tokens; then (on ``due()``) move that job's deadline to now and let the step go on."""
    engine, step = worker.engine, worker.engine.step
    tokens: Counter = Counter()
    held, go = threading.Event(), threading.Event()

    def gated():
        events, preempted = step()
        for e in events:
            tokens[e.uid] += 1
        timed = [u for u, j in list(worker.active.items()) if j.deadline is not None]
        if not go.is_set() and any(tokens[u] >= n for u in timed):
            held.set()
            go.wait()
        return events, preempted

    def due():
        assert held.wait(timeout=120)
        jobs = [j for j in list(worker.active.values()) if j.deadline is not None]
        assert jobs and all(j.deadline > time.monotonic() for j in jobs)  # not due by itself yet
        for j in jobs:
            j.deadline = time.monotonic()
        go.set()

    engine.step = gated
    try:
        yield due
    finally:
        go.set()
        del engine.step


def _check_prefix(tiny_model, ids, text):
    ref = reference_tokens(tiny_model, PROMPT, MAX_TOKENS, ignore_eos=True)
    assert 5 <= len(ids) < MAX_TOKENS
    assert ids == ref[:len(ids)]
    assert text == tiny_model.tokenizer.decode(ids)


def test_a_job_past_its_timeout_ends_timeout_with_its_tokens_so_far(tiny_model, redis_url):
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    with running_worker(tiny_model, redis_url, settings, max_batch=4) as w, held_then_due(w) as due:
        job = client.submit(prompt_tokens=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, timeout_s=60)
        follower = StreamCollector(job)
        follower.start()
        due()
        res = job.result(timeout=60)
        follower.join(timeout=30)
        quick = asyncio.run(_async_submit(redis_url, settings, timeout_s=60))  # well within its limit
    assert res.finish_reason == "timeout" and job.status() == "done"
    _check_prefix(tiny_model, res.token_ids, res.text)
    assert follower.error is None and follower.ids == res.token_ids and follower.text == res.text
    assert follower.finishes == ["timeout"]
    assert quick.finish_reason == "length" and len(quick.token_ids) == 3
    with pytest.raises(ValueError, match="timeout_s"):
        asyncio.run(_async_submit(redis_url, settings, timeout_s=-1))


async def _async_submit(url, settings, **params):
    from mlxq import AsyncClient

    async with AsyncClient(url, model="tiny", settings=settings) as client:
        job = await client.submit(prompt_tokens=PROMPT, max_tokens=3, ignore_eos=True, **params)
        return await job.result(timeout=60)


@pytest.mark.parametrize("value", [0, -1.5, math.nan, math.inf, "5", "soon", True, [1]])
def test_a_bad_timeout_is_refused_at_submit(redis_url, value):
    from mlxq.shared.genopts import check_defaults, error_text
    from mlxq.shared.schemas import GenerateRequest

    with pytest.raises(ValueError) as err:
        GenerateRequest(model="tiny", prompt="hi", timeout_s=value)
    assert error_text(err.value).startswith("timeout_s: ")
    with pytest.raises(ValueError, match="timeout_s"):  # mlxq batch's defaults: refused before queueing
        check_defaults({"timeout_s": value})


def test_timeout_flags_of_submit_and_batch():
    from mlxq.cli import build_parser
    from mlxq.cli.output import output_params

    for argv in (["submit", "hi", "--timeout-s", "2.5"], ["batch", "in.jsonl", "-o", "out.jsonl", "--timeout-s", "2.5"]):
        args = build_parser().parse_args(argv)
        assert output_params(args)["timeout_s"] == 2.5


def test_the_gateway_shows_a_timeout_as_length_with_the_reason_beside_it(tiny_model, redis_url):
    settings = fast_settings(redis_url)
    body = dict(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS)
    extra = {"ignore_eos": True, "timeout_s": 60}
    with running_worker(tiny_model, redis_url, settings, max_batch=4) as w:
        assert wait_for(lambda: Client(redis_url, settings=settings).redis.hexists("mlxq:models", "tiny"), 60)
        with ServerThread(create_app(redis_url, settings)) as url:
            oai = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120)
            with held_then_due(w) as due:
                box: dict = {}
                t = threading.Thread(target=lambda: box.update(r=oai.completions.create(**body, extra_body=extra)))
                t.start()
                due()
                t.join(timeout=120)
            ref = reference_tokens(tiny_model, PROMPT, MAX_TOKENS, ignore_eos=True)
            [choice] = box["r"].choices
            assert choice.finish_reason == "length" and choice.model_extra["mlxq_finish_reason"] == "timeout"
            k = box["r"].usage.completion_tokens
            assert 5 <= k < MAX_TOKENS and choice.text == tiny_model.tokenizer.decode(ref[:k])

            with held_then_due(w) as due:
                chunks: list = []
                t = threading.Thread(target=lambda: chunks.extend(oai.completions.create(
                    **body, stream=True, stream_options={"include_usage": True}, extra_body=extra)))
                t.start()
                due()
                t.join(timeout=120)
            *text_chunks, usage = chunks
            last = text_chunks[-1].choices[0]
            assert last.finish_reason == "length" and last.model_extra["mlxq_finish_reason"] == "timeout"
            assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
            k = usage.usage.completion_tokens
            streamed = "".join(c.choices[0].text for c in text_chunks)
            assert 5 <= k < MAX_TOKENS and streamed == tiny_model.tokenizer.decode(ref[:k])

            for bad in (0, "soon", -3):
                with pytest.raises(openai.BadRequestError) as err:
                    oai.completions.create(**body, extra_body={"timeout_s": bad})
                assert json.loads(err.value.response.text)["error"]["param"] == "timeout_s"


def test_a_requeue_keeps_what_the_job_ran_and_a_new_attempt_starts_again(tiny_model):
    """Handed back (preemption, warm shutdown: the same attempt) the job's resume state carries what it
    ran of its timeout_s, and its next run has only the rest; after its worker died (a new attempt)
    the clock starts again, as rq gives each retry its job_timeout."""
    from mlxq.shared import codec
    from mlxq.shared.protocol import Pulled
    from mlxq.shared.schemas import GenerateRequest
    from mlxq.worker.jobs import start_job

    req = GenerateRequest(model="tiny", prompt_tokens=PROMPT, max_tokens=8, timeout_s=100)

    def run(attempt, resume=b""):
        pulled = Pulled(job_id=req.id, kind="job", raw_request=b"", attempt=attempt, tier="normal", score=0.0,
                        queued_at=0.0, resume=resume, now=0.0)
        [job] = start_job(pulled, req, PROMPT, tiny_model.tokenizer, "w", 0.0)
        return job

    first = run(1)
    first.deadline -= 30  # as if it had run for 30 s
    state = first.resume_state()
    assert 30 <= codec.unpack(state)["ran_s"] < 100
    assert run(1, state).deadline - time.monotonic() <= 70  # the same attempt, requeued: the rest
    assert run(2, state).deadline - time.monotonic() > 70  # a new attempt: its own 100 s
