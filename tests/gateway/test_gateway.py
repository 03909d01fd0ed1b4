"""The OpenAI-compatible gateway, driven by the real ``openai`` client: uvicorn on a loopback port in
a thread, a worker on the tiny model, a real Valkey."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlparse

import openai
import pytest
import redis

from mlxq.shared import apikeys, codec
from mlxq.shared.keys import GlobalKeys
from workerkit import fast_settings, job_fields, raw_post, running_worker, wait_for

from mlxq import Client
from mlxq.producer.gateway import ServerThread, create_app

GK = GlobalKeys()
KEY_HIGH = "high-key-0001"
KEY_REVOKED = "revoked-key-0001"


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model):
    """(gateway url, redis) with a worker serving "tiny" for the whole module."""
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    apikeys.add_key(r, GK.api_keys, KEY_HIGH, "high")
    apikeys.add_key(r, GK.api_keys, KEY_REVOKED, "normal")
    apikeys.revoke_key(r, GK.api_keys, KEY_REVOKED)
    # the module's requests without a token are served (keys registered refuse them unless let in)
    apikeys.set_policy(r, GK, anonymous="normal")
    settings = fast_settings(redis_server.url)
    with running_worker(tiny_model, redis_server.url, settings, max_batch=8):
        assert wait_for(lambda: r.hexists(GK.models, "tiny"), timeout=60)
        with ServerThread(create_app(redis_server.url, settings)) as url:
            yield url, r
    r.close()


def oai(url: str, key: str = KEY_HIGH) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def job_hash(r, job_id: str) -> dict:
    return job_fields(r, GK.model_keys("tiny").job(job_id))


def test_models_lists_the_served_model(stack):
    url, _ = stack
    models = oai(url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):  # keys exist: an unknown key is refused everywhere
        oai(url, "EMPTY").models.list()


def test_chat_non_streaming_with_usage(stack):
    url, r = stack
    resp = oai(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                            max_tokens=6, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str)
    assert resp.usage.completion_tokens == 6
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 6
    assert job_hash(r, resp.id.removeprefix("chatcmpl-"))["tier"] == b"high"  # the key decides the tier


def test_chat_streaming_matches_the_result_and_reports_usage(stack):
    url, r = stack
    client = oai(url)
    msgs = [{"role": "user", "content": "stream me"}]
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=8,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=8, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    final = codec.unpack(job_hash(r, chunks[0].id.removeprefix("chatcmpl-"))["result"])
    assert text == final["text"]  # the stream carried exactly the job's output
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_streaming_non_streaming_and_logprobs(stack):
    url, r = stack
    client = oai(url)
    resp = client.completions.create(model="tiny", prompt="once upon a time", max_tokens=5, logprobs=2,
                                     extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert resp.object == "text_completion" and resp.usage.completion_tokens == 5
    # top_logprobs is keyed by token text: alternatives that are bytes of one UTF-8 character are all
    # named "\ufffd" and count once (for some weights)
    top = choice.logprobs.top_logprobs[0]
    assert len(choice.logprobs.tokens) == 5 and (len(top) == 2 or (len(top) == 1 and "\ufffd" in top))
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    chunks = list(client.completions.create(model="tiny", prompt="once upon a time", max_tokens=5, stream=True,
                                            extra_body={"ignore_eos": True}))
    final = codec.unpack(job_hash(r, chunks[0].id.removeprefix("cmpl-"))["result"])
    assert "".join(c.choices[0].text for c in chunks) == final["text"]
    assert chunks[-1].choices[0].finish_reason == "length"
    tokens = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert tokens.usage.prompt_tokens == 4 and tokens.usage.completion_tokens == 3


def test_chat_logprobs(stack):
    url, _ = stack
    resp = oai(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                            logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 3
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_auth_tiers_and_batch_floor(stack):
    url, r = stack
    with pytest.raises(openai.AuthenticationError) as err:
        oai(url, "nobody-knows-this-key").chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                                           "content": "hi"}])
    assert err.value.status_code == 401 and err.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        oai(url, KEY_REVOKED).completions.create(model="tiny", prompt="hi", max_tokens=2)
    # no token: 401 once keys are registered, unless anonymous callers are let in (`mlxq tiers --anonymous`)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    apikeys.set_policy(r, GK, anonymous="default")
    try:
        status, body = raw_post(url, "/v1/chat/completions", chat)
        assert status == 401 and "API key is required" in body["error"]["message"]
    finally:
        apikeys.set_policy(r, GK, anonymous="normal")
    status, body = raw_post(url, "/v1/chat/completions", chat)
    assert status == 200 and job_hash(r, body["id"].removeprefix("chatcmpl-"))["tier"] == b"normal"
    # /v1/batch/ lowers even a high key to the low tier
    status, body = raw_post(url, "/v1/batch/chat/completions",
                            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                            {"Authorization": f"Bearer {KEY_HIGH}"})
    assert status == 200 and job_hash(r, body["id"].removeprefix("chatcmpl-"))["tier"] == b"low"


@pytest.mark.parametrize("body,param", [
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 3.5}, "temperature"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content"),
])
def test_validation_errors_are_openai_shaped(stack, body, param):
    url, _ = stack
    status, out = raw_post(url, "/v1/chat/completions", body)
    assert status == 400
    assert set(out["error"]) == {"message", "type", "param", "code"}
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == param


def test_a_body_over_the_limit_is_refused_before_it_is_read_whole():
    """413 on a declared length over the limit without reading it, and on a streamed body as soon
    as it passes the limit; a body within it parses."""
    import asyncio

    from starlette.requests import Request

    from mlxq.producer.gateway.jobs import json_body
    from mlxq.producer.openai_api import OpenAIError

    def request(chunks, length=None):
        sent = []

        async def receive():
            body = chunks[len(sent)] if len(sent) < len(chunks) else b""
            sent.append(body)
            return {"type": "http.request", "body": body, "more_body": len(sent) < len(chunks)}

        headers = [(b"content-length", str(length).encode())] if length is not None else []
        return Request({"type": "http", "method": "POST", "headers": headers}, receive), sent

    def read(req, limit):
        return asyncio.run(json_body(req, limit))

    req, sent = request([b"{}"], length=10_000)
    with pytest.raises(OpenAIError) as e:
        read(req, 1000)
    assert e.value.status == 413 and e.value.code == "request_too_large" and sent == []
    req, sent = request([b"[" + b"1," * 400] * 10)  # no length given: 8 KB in 10 chunks
    with pytest.raises(OpenAIError) as e:
        read(req, 1000)
    assert e.value.status == 413 and len(sent) == 2  # stopped at the chunk that passed the limit
    req, _ = request([b'{"prompt": ', b'"hi"}'], length=17)
    assert read(req, 1000) == {"prompt": "hi"}


def test_bad_json_unknown_model_and_openai_client_errors(stack):
    url, _ = stack
    status, out = raw_post(url, "/v1/completions", b"{not json")
    assert status == 400 and out["error"]["code"] == "invalid_json"
    status, out = raw_post(url, "/v1/completions", {"model": "nope", "prompt": "hi"})
    assert status == 404 and out["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        oai(url).completions.create(model="tiny", prompt="hi", n=17)  # above the most samples per job


# "ghost": a model whose (pretend) worker heartbeats for the whole test but never pulls a job
GHOST = {"name": "ghost", "context_length": 4096, "max_token_bytes": 8, "seen_at": time.time() + 10 * 365 * 86400}


def test_overload_is_429(stack, redis_server):
    """A gateway whose queues hold one job per tier, for a model no worker drains."""
    url, r = stack
    r.hset(GK.models, "ghost", codec.pack(GHOST))
    small = fast_settings(redis_server.url)
    apikeys.set_policy(r, GK, max_queued=1)  # the bound lives in Redis (`mlxq tiers --max-queued`)
    try:
        Client(redis_server.url, api_key=KEY_HIGH, model="ghost", settings=small).submit("a", max_tokens=2)
        with ServerThread(create_app(redis_server.url, small)) as u2:
            with pytest.raises(openai.RateLimitError) as err:
                oai(u2).completions.create(model="ghost", prompt="b", max_tokens=2)
            assert err.value.status_code == 429 and err.value.body["type"] == "rate_limit_error"
    finally:
        apikeys.set_policy(r, GK, max_queued=10_000)
        r.hdel(GK.models, "ghost")


def _cancelled(r, job_id):
    return job_hash(r, job_id).get("status") == b"cancelled"


def test_stream_disconnect_cancels_the_job(stack):
    url, r = stack
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    job_id = None
    while job_id is None:
        line = resp.fp.readline().decode()
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if chunk["choices"][0]["text"]:
                job_id = chunk["id"].removeprefix("cmpl-")
    assert job_hash(r, job_id)["status"] == b"running"
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    assert wait_for(lambda: _cancelled(r, job_id), timeout=60)


def test_non_streaming_disconnect_cancels_the_job(stack):
    url, r = stack
    known = set(r.keys(GK.model_keys("tiny").job("*")))
    with pytest.raises(TimeoutError):
        raw_post(url, "/v1/chat/completions",
                 {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4000,
                  "ignore_eos": True}, timeout=0.6)
    new = [k for k in r.keys(GK.model_keys("tiny").job("*")) if k not in known]
    assert len(new) == 1
    job_id = new[0].decode().rsplit(":", 1)[-1]
    assert wait_for(lambda: _cancelled(r, job_id), timeout=60)


def test_metrics_endpoint_parses(stack):
    from prometheus_client.parser import text_string_to_metric_families

    url, r = stack
    oai(url).completions.create(model="tiny", prompt="m", max_tokens=2)
    named = "reporting-key-0001"
    apikeys.add_key(r, GK.api_keys, named, "normal", name="reporting")
    oai(url, named).completions.create(model="tiny", prompt="m", max_tokens=2)
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "mlxq_gateway_requests" in families
    assert "mlxq_queue_depth" not in families  # one worker per model exports it (test_health.py)
    ok = [s for s in families["mlxq_gateway_requests"].samples
          if s.labels.get("endpoint") == "/v1/completions" and s.labels.get("status") == "200"
          and s.name.endswith("_total")]
    assert ok and ok[0].value >= 1
    latency = [s for s in families["mlxq_gateway_request_seconds"].samples if s.name.endswith("_count")
               and s.labels.get("endpoint") == "/v1/completions"]
    assert latency and {s.labels["tier"] for s in latency} <= {"high", "normal", "low"}
    # requests by the key's name, never the key or its hash
    by_key = {s.labels["key"]: s.value for s in families["mlxq_gateway_key_requests"].samples
              if s.name.endswith("_total")}
    assert by_key.get("reporting", 0) >= 1 and named not in text and apikeys.key_hash(named) not in text


def test_json_log_lines_carry_job_and_attempt():
    import logging

    from mlxq.producer.gateway.jobs import jlog
    from mlxq.shared.logs import JsonFormatter

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    gw_log = logging.getLogger("mlxq.gateway")
    gw_log.addHandler(handler)
    old = gw_log.level
    gw_log.setLevel(logging.INFO)
    try:
        jlog(logging.INFO, "ab" * 16, 2, "finished: %s", "stop")
    finally:
        gw_log.removeHandler(handler)
        gw_log.setLevel(old)
    line = json.loads(JsonFormatter().format(records[0]))
    assert line["job"] == "ab" * 16 and line["attempt"] == 2
    assert line["message"] == f"job={'ab' * 16} attempt=2 finished: stop"


def test_disconnect_while_waiting_for_the_first_token_cancels_the_job(stack):
    """A stream's headers wait for the job's first delta; a client that leaves before it (here the job
    stays queued: no worker serves "ghost") still cancels its job."""
    url, r = stack
    r.hset(GK.models, "ghost", codec.pack(GHOST))
    ghost = GK.model_keys("ghost")
    try:
        before = set(r.zrange(ghost.queue, 0, -1))  # (an earlier test leaves a job there)
        u = urlparse(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        body = {"model": "ghost", "prompt": "never starts", "max_tokens": 4, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        assert wait_for(lambda: set(r.zrange(ghost.queue, 0, -1)) - before, timeout=10)
        (job_id,) = [m.decode() for m in set(r.zrange(ghost.queue, 0, -1)) - before]
        conn.sock.close()
        conn.close()
        assert wait_for(lambda: r.hget(ghost.job(job_id), "status") == b"cancelled", timeout=15)
    finally:
        r.hdel(GK.models, "ghost")


def test_a_failed_sample_ends_the_stream_and_cancels_the_samples_still_running():
    """n > 1: one sample's error ends the SSE stream with an error event, and the job's other
    samples, which would now run for nobody, are cancelled (and only then)."""
    import asyncio
    from types import SimpleNamespace

    from mlxq.producer.gateway import Gateway
    from mlxq.producer.gateway.chat_completions import ChatCompletions, _Meta
    from mlxq.shared.schemas import Delta
    from mlxq.shared.settings import Settings

    class Job:
        id = "j1"

        def __init__(self, deltas):
            self.deltas, self.cancelled, self.closed = deltas, 0, False

        async def cancel(self):
            self.cancelled += 1
            return "cancelled"

        async def result(self, timeout=None):
            return SimpleNamespace(finish_reason="error", stats=SimpleNamespace(generated_tokens=1, attempts=1))

    async def stream(job, n):
        gw = Gateway(settings=Settings(redis_url="redis://unused"))
        meta = _Meta(id="c1", model="m", created=0, chat=False, endpoint="/v1/completions", started=0.0,
                     include_usage=False, n=n)

        async def deltas():
            try:
                for d in job.deltas:
                    yield d
            finally:
                job.closed = True  # as AsyncJob.stream's own finally: it unsubscribes the job's channel

        events = [e async for e in ChatCompletions(gw)._sse(job, meta, None, deltas())]
        # the job's stream is closed when the SSE ends, not when the generator is collected: left
        # open, its channel stayed subscribed for as long as the gateway ran
        assert job.closed
        await asyncio.gather(*gw._background)
        return events

    running = Job([Delta(sample=0, text="a"), Delta(sample=1, finish_reason="error", error="boom")])
    events = asyncio.run(stream(running, 3))
    assert any('"job_failed"' in e and "boom" in e for e in events) and events[-1] == "data: [DONE]\n\n"
    assert running.cancelled == 1
    # every other sample had ended already: nothing to cancel
    last = Job([Delta(sample=0, text="a", finish_reason="stop"), Delta(sample=1, finish_reason="error", error="x")])
    asyncio.run(stream(last, 2))
    assert last.cancelled == 0


def test_a_stream_ends_at_done_without_waiting_for_the_result():
    """The SSE response ends right after [DONE]; reading the job's result (for the token counter and
    the log) happens after it. The response used to wait for it, and a result that did not come cut
    the response off with an error after [DONE], which the openai client reads to the end."""
    import asyncio

    from mlxq.producer.gateway import Gateway
    from mlxq.producer.gateway.chat_completions import ChatCompletions, _Meta
    from mlxq.shared.schemas import Delta
    from mlxq.shared.settings import Settings

    class Job:
        id = "j1"

        async def result(self, timeout=None):
            await asyncio.Event().wait()  # never comes

    async def stream():
        gw = Gateway(settings=Settings(redis_url="redis://unused"))
        meta = _Meta(id="c1", model="m", created=0, chat=False, endpoint="/v1/completions", started=0.0,
                     include_usage=False, n=1)

        async def deltas():
            yield Delta(seq=1, text="hi", token_ids=[5], finish_reason="stop")

        events = await asyncio.wait_for(_collect(ChatCompletions(gw)._sse(Job(), meta, None, deltas())), 30)
        for task in list(gw._background):
            task.cancel()
        return events

    async def _collect(gen):
        return [e async for e in gen]

    events = asyncio.run(stream())
    assert events[-1] == "data: [DONE]\n\n" and '"hi"' in events[0]


def test_a_failed_sample_fails_a_request_without_stream_as_it_ends_a_stream():
    """n > 1 without streaming: any sample's error is the request's error, as a stream ends with it
    (before, only sample 0's was: a later sample's failure came back as a 200 with that choice's
    text cut short)."""
    import asyncio

    from mlxq.producer.gateway import Gateway
    from mlxq.producer.gateway.chat_completions import ChatCompletions, _Meta
    from mlxq.shared.schemas import JobStats, Result, SampleOutput
    from mlxq.shared.settings import Settings

    outputs = [SampleOutput(index=0, text="fine", finish_reason="stop"),
               SampleOutput(index=1, text="cut", finish_reason="error", error="boom", error_code="internal_error")]

    class Job:
        id = "j1"

        async def result(self, timeout=None):
            return Result(id="j1", text="fine", finish_reason="stop", samples=outputs,
                          stats=JobStats(queued_at=0, started_at=0, finished_at=0, attempts=1))

    class Request:
        async def receive(self):
            await asyncio.Event().wait()  # the client stays

    async def answer():
        gw = Gateway(settings=Settings(redis_url="redis://unused"))
        meta = _Meta(id="c1", model="m", created=0, chat=False, endpoint="/v1/completions", started=0.0,
                     include_usage=False, n=2)
        return await ChatCompletions(gw)._complete(Request(), Job(), meta, None)

    response = asyncio.run(answer())
    assert response.status_code == 500
    assert json.loads(response.body)["error"] == {"message": "boom", "type": "server_error", "param": None,
                                                  "code": "job_failed"}
    # mlxq batch writes the line the gateway would answer
    from mlxq.producer.bulk import batch_line

    line = batch_line(1, "c1", "j1", "m", False, asyncio.run(Job().result()))["response"]
    assert line["status_code"] == 500 and line["body"]["error"]["message"] == "boom"


def test_logprob_token_names_keep_special_tokens_as_the_text_does(tiny_model, tiny_model_dir):
    """A token's name in logprobs is its text as the worker's text has it, special tokens included
    (an EOS generated under ignore_eos): it was "" before, so the names stopped joining to the text
    and text_offset drifted from it."""
    from mlxq.producer.openai_api import TokenNames
    from mlxq.worker.textstream import decode_fn

    names = TokenNames().for_model({"source": str(tiny_model_dir)})
    decode = decode_fn(tiny_model.tokenizer)
    special = sorted(tiny_model.eos_token_ids)[0]
    assert names(special) == decode([special]) != ""
    for i in (5, 50, 500):
        assert names(i) == decode([i])


def test_the_gateways_prompt_count_is_the_workers(tiny_model, tiny_model_dir):
    """The gateway counts a text prompt's tokens (to refuse one that cannot fit before queueing it)
    with the tokenizer's encode_batch, which lets go of the GIL: the same count as the worker's
    encoding of the same text."""
    from mlxq.producer.openai_api import TokenNames

    count = TokenNames().counter({"source": str(tiny_model_dir)})
    for text in ("", "hello", "Once upon a time, " * 50, "naïve café — 東京 🙂\n\t"):
        assert count(text) == len(tiny_model.tokenizer.encode(text))


def _strict_json(text: str):
    """JSON as strict parsers read it: -Infinity, Infinity and NaN are errors."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def raw_request(url: str, method: str, path: str, body=None) -> tuple[int, str, str]:
    """(status, content type, body text) of one request, the body sent as JSON text if given."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, resp.getheader("content-type") or "", resp.read().decode()
    conn.close()
    return out


def test_logprobs_of_tokens_a_grammar_forbids_are_valid_json(stack):
    """A constraint masks forbidden tokens to -inf before log-probabilities are taken, so the top
    alternatives at the first position of a JSON answer are mostly -inf. JSON has no -Infinity: the
    reply was a 500 and the stream carried -Infinity, which strict parsers refuse. They read
    -9999.0 now (as vLLM shows them), streamed or not, on both endpoints."""
    url, _ = stack
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "logprobs": True, "top_logprobs": 20, "response_format": {"type": "json_object"}}
    status, _, text = raw_request(url, "POST", "/v1/chat/completions", chat)
    assert status == 200, text
    first = _strict_json(text)["choices"][0]["logprobs"]["content"][0]
    alternatives = [t["logprob"] for t in first["top_logprobs"]]
    assert len(alternatives) == 20 and -9999.0 in alternatives  # a 20-token JSON start is impossible
    assert all(v >= -9999.0 for v in alternatives) and first["logprob"] > -9999.0  # the drawn token is allowed
    status, _, text = raw_request(url, "POST", "/v1/chat/completions", dict(chat, stream=True))
    assert status == 200
    chunks = [_strict_json(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    tops = [t["logprob"] for c in chunks for ch in c["choices"] for e in ((ch.get("logprobs") or {}).get("content") or [])
            for t in e["top_logprobs"]]
    assert -9999.0 in tops
    completion = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "logprobs": 20,
                  "response_format": {"type": "json_object"}}
    status, _, text = raw_request(url, "POST", "/v1/completions", completion)
    assert status == 200, text
    assert -9999.0 in _strict_json(text)["choices"][0]["logprobs"]["top_logprobs"][0].values()


def test_errors_outside_the_routes_are_in_openais_shape(stack):
    """A path no route serves, a method a route does not take, and a body nested deeper than the
    JSON parser goes: OpenAI's error object, not Starlette's plain text or an unhandled 500."""
    url, _ = stack
    for method, path, body, status in (("POST", "/v1/nothing", {}, 404), ("GET", "/v1/chat/completions", None, 405),
                                       ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400)):
        got, ctype, text = raw_request(url, method, path, body)
        assert got == status and ctype.startswith("application/json"), (method, path, got, text[:200])
        assert set(_strict_json(text)["error"]) == {"message", "type", "param", "code"}


def test_a_strict_schema_nested_too_deeply_is_a_400(stack):
    url, _ = stack
    schema: dict = {"type": "string"}
    for _ in range(400):  # 800 dicts deep: JSON writes it, the recursive closing did not get through it
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "strict": True, "schema": schema}}}
    status, _, text = raw_request(url, "POST", "/v1/chat/completions", body)
    message = _strict_json(text)["error"]["message"]
    # refused by the closing (too deep for it) or by the grammar compiler (its recursion limit)
    assert status == 400 and ("nested too deeply" in message or "recursion limit" in message), text[:300]


def test_an_assistant_message_as_the_gateway_returned_it_is_accepted(stack):
    """The usual agent loop appends the reply's message and asks again: its reasoning_content (a model
    that thinks) is dropped, not refused; on a user message it is still refused."""
    url, _ = stack
    turn = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning_content": "a greeting", "refusal": None},
            {"role": "user", "content": "again"}]
    status, body = raw_post(url, "/v1/chat/completions", {"model": "tiny", "messages": turn, "max_tokens": 2})
    assert status == 200, body
    turn[0]["reasoning_content"] = "no"
    status, body = raw_post(url, "/v1/chat/completions", {"model": "tiny", "messages": turn, "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "messages.0.reasoning_content"


def test_stream_options_without_stream_is_refused_and_a_null_max_tokens_is_the_default(stack):
    url, _ = stack
    status, body = raw_post(url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                     "stream_options": {"include_usage": True}})
    assert status == 400 and body["error"]["param"] == "stream_options"
    status, body = raw_post(url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": None,
                                                     "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 16  # OpenAI's default for the endpoint


def test_a_bad_field_is_named_as_the_request_names_it(stack):
    """A 400's param is the request's field path, without the union member pydantic tried
    ("messages.0.content.str", "tool_choice.literal[...]")."""
    url, _ = stack
    for extra, param in (({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
                         ({"tool_choice": 5}, "tool_choice"), ({"stop": [1]}, "stop")):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
        status, got = raw_post(url, "/v1/chat/completions", body)
        assert status == 400 and got["error"]["param"] == param, got


def test_a_client_gone_before_its_body_ended_is_a_499_not_a_500(stack):
    """A client that disconnects while its body is still coming: nothing is queued, and the gateway
    counts a 499 (it was an unhandled ClientDisconnect: a 500 and a traceback)."""
    import socket

    url, _ = stack
    u = urlparse(url)

    def count_499() -> float:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("mlxq_gateway_requests_total{") and 'status="499"' in line
                   and 'endpoint="/v1/completions"' in line)

    before = count_499()
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\"")
    assert wait_for(lambda: count_499() > before, timeout=15)


def test_a_call_only_answer_has_no_content():
    """Parallel calls may be a line apart; that line is no answer: content is None, as OpenAI returns a
    message that only calls (it was "\\n"). Text beside the calls stays; no calls, "" stays ""."""
    from mlxq.producer.openai_api import chat_message
    from mlxq.shared.schemas import Result, ToolCall

    calls = [ToolCall(id=f"call_{i}", function={"name": "f", "arguments": "{}"}) for i in range(2)]
    def result(text, **kw):
        return Result(id="j", finish_reason="tool_calls" if kw else "stop", text=text, **kw)

    assert chat_message(result("\n", tool_calls=calls))["content"] is None
    assert chat_message(result("Let me check.\n", tool_calls=calls))["content"] == "Let me check.\n"
    assert chat_message(result(""))["content"] == "" and chat_message(result(" "))["content"] == " "


def test_a_jobs_life_travels_in_the_body_and_bad_times_or_webhooks_are_a_400(stack):
    """docs/pipelines/job-life.md: an expiry already past, or a webhook host the operator did not allow, is
    refused before anything is queued; a job with an expiry it meets runs as any other."""
    url, r = stack
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    queued = r.hget(GK.model_keys("tiny").counts, "submitted")
    status, out = raw_post(url, "/v1/chat/completions", {**chat, "expires_at": time.time() - 10})
    assert status == 400 and "already past" in out["error"]["message"]
    status, out = raw_post(url, "/v1/chat/completions", {**chat, "webhook": "https://evil.example.net/x"})
    assert status == 400 and "not allowed" in out["error"]["message"]
    assert r.hget(GK.model_keys("tiny").counts, "submitted") == queued
    status, out = raw_post(url, "/v1/chat/completions", {**chat, "expires_in": 600})
    assert status == 200 and out["choices"][0]["finish_reason"] in ("stop", "length")
