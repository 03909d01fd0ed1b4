"""The gateway as a new user meets it, with the official ``openai`` client: open until a key exists
(``api_key="EMPTY"`` works, as with vLLM, ollama and mlx-lm's server), then 401 for unknown keys on every
endpoint; chat on a model without a chat template; completions that keep their leading space; jobs
that cannot run answered 400 before any streaming.

The worker serves the tiny model's weights under the name "plain" with a tokenizer that has no chat
template (a copy of the tiny tokenizer files without ``chat_template``)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import shutil
from urllib.parse import urlparse

import openai
import pytest
import redis

from mlxq import Client
from mlxq.shared import apikeys, codec
from mlxq.shared.keys import GlobalKeys
from workerkit import fast_settings, job_fields, running_worker, wait_for
from refkit import pick_prompt

from mlxq.producer.gateway import ServerThread, create_app

GK = GlobalKeys()
KEYS = GK.model_keys("plain")


@pytest.fixture(scope="module")
def plain_model(tiny_model, tiny_model_dir, tmp_path_factory):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    d = tmp_path_factory.mktemp("plain-model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(tiny_model_dir / name, d / name)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(d, eos_token_ids=list(tiny_model.eos_token_ids))
    assert not tok.chat_template
    return dataclasses.replace(tiny_model, tokenizer=tok, name="plain", source=str(d))


@pytest.fixture(scope="module")
def open_stack(redis_server, plain_model):
    """(gateway url, redis, captured gateway log records); no API key registered at start."""
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    gw_log = logging.getLogger("mlxq.gateway")
    gw_log.addHandler(handler)
    settings = fast_settings(redis_server.url)
    try:
        with running_worker(plain_model, redis_server.url, settings, max_batch=4):
            assert wait_for(lambda: r.hexists(GK.models, "plain"), timeout=10)
            with ServerThread(create_app(redis_server.url, settings)) as url:
                yield url, r, records
    finally:
        gw_log.removeHandler(handler)
        r.close()


def oai(url: str, key: str = "EMPTY") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def result_of(r, job_id: str) -> dict:
    res = codec.unpack(r.hget(KEYS.job(job_id), "result"))
    return {**res, "token_ids": codec.unpack_ids(res["token_ids"])}  # the record keeps them as a string


def get(url: str, path: str, key: str | None = None) -> int:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    status = conn.getresponse().status
    conn.close()
    return status


def test_open_until_a_key_exists_then_401_everywhere(open_stack):
    url, r, records = open_stack
    assert any("OPEN" in rec.getMessage() for rec in records)  # warned at start
    client = oai(url)  # api_key="EMPTY", as for vLLM / ollama / mlx-lm's server
    assert [m.id for m in client.models.list().data] == ["plain"]
    resp = client.completions.create(model="plain", prompt="hi", max_tokens=2)
    assert job_fields(r, KEYS.job(resp.id.removeprefix("cmpl-")))["tier"] == b"normal"
    apikeys.add_key(r, GK.api_keys, "the-first-key-01", "high")
    try:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="plain", prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError) as err:
            client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}])
        assert err.value.body["code"] == "invalid_api_key"
        assert get(url, "/metrics", "EMPTY") == 401
        assert get(url, "/health", "EMPTY") == 200  # liveness: no key checked (test_health.py)
        assert get(url, "/metrics") == 401  # no token at all: refused too, once keys exist (keys mean keys)
        keyed = oai(url, "the-first-key-01")
        assert [m.id for m in keyed.models.list().data] == ["plain"]
        resp = keyed.completions.create(model="plain", prompt="hi", max_tokens=2)
        assert job_fields(r, KEYS.job(resp.id.removeprefix("cmpl-")))["tier"] == b"high"
        # the Python client follows the same rule
        with pytest.raises(apikeys.AuthError):
            Client(api_key="EMPTY", model="plain", redis_client=r).submit("x", max_tokens=1)
    finally:
        r.delete(GK.api_keys)  # back to open mode for the tests below ...
        apikeys.set_policy(r, GK)  # ... and re-copied into the model's slot, as any admin change is


def test_chat_without_a_template_falls_back_to_role_prefixed_text(open_stack, plain_model):
    url, r, _ = open_stack
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    resp = oai(url).chat.completions.create(model="plain", messages=msgs, max_tokens=4,
                                            extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    plain = "ASSISTANT's RULE: be brief\nUSER: hello there\nASSISTANT:"  # mlx-lm server's convert_chat
    assert resp.usage.prompt_tokens == len(plain_model.tokenizer.encode(plain))
    res = result_of(r, resp.id.removeprefix("chatcmpl-"))
    # chat content is exactly the decoded tokens too (no space forced or trimmed), as vLLM returns it
    assert resp.choices[0].message.content == plain_model.tokenizer.decode(res["token_ids"]) == res["text"]
    chunks = list(oai(url).chat.completions.create(model="plain", messages=msgs, max_tokens=4, stream=True,
                                                   extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == resp.choices[0].message.content


# Prompts that end on a word: a model trained on English-like text continues them with a token that
# starts with a space.  Which one does depends on this run's weights (seed, BLAS): the test picks it
# from the model's greedy answers, computed here (refkit).
SPACE_PROMPTS = ("A recipe for bread starts with", "The weather today is", "Tell me about the",
                 "The old bridge over the river", "She opened the door and", "In the morning we",
                 "The children walked to", "He wrote a letter to")


def leading_space_case(loaded, n: int) -> tuple[str, str, str]:
    """(prompt, the greedy text, a stop string): a prompt whose greedy answer has ``n`` tokens
    before any EOS and a first token that starts with a space, and the second token's text (stripped)
    as a stop string: it occurs in the answer, after the first token and before the last one."""
    tok = loaded.tokenizer

    def split(ids):  # (the first token's text, the stop string)
        first = tok.decode(ids[:1])
        return first, tok.decode(ids[:2])[len(first):].strip()

    def wanted(ids, text):
        first, stop = split(ids)
        return len(ids) == n and first.startswith(" ") and "\ufffd" not in first + stop \
            and bool(stop) and stop not in first

    prompt, ids, text = pick_prompt(loaded, SPACE_PROMPTS, n, wanted, "a first token that starts with a space")
    return prompt, text, split(ids)[1]


def test_completions_keep_the_leading_space(open_stack, plain_model):
    """A completion whose first token starts with a space keeps it, as OpenAI and vLLM return it (say
    " the table."); mlx-lm's streaming detokenizer would have dropped it ("the table.")."""
    url, r, _ = open_stack
    prompt, expected, stop = leading_space_case(plain_model, 3)
    client = oai(url)
    resp = client.completions.create(model="plain", prompt=prompt, max_tokens=3)
    res = result_of(r, resp.id.removeprefix("cmpl-"))
    assert resp.choices[0].text == expected == plain_model.tokenizer.decode(res["token_ids"])
    chunks = list(client.completions.create(model="plain", prompt=prompt, max_tokens=3, stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == expected and pieces[0].startswith(" ")
    # stop strings still cut; the Python client gives the same text
    stopped = client.completions.create(model="plain", prompt=prompt, max_tokens=3, stop=[stop])
    assert stopped.choices[0].text == expected[: expected.index(stop)] and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text.startswith(" ")
    job = Client(redis_client=r, model="plain").submit(prompt, max_tokens=3)
    assert "".join(d.text for d in job.stream(timeout=30)) == job.result(timeout=30).text == expected
    usage = job.result().usage  # Job.result() carries usage too
    assert (usage.completion_tokens, usage.cached_tokens) == (3, 0)
    assert usage.total_tokens == usage.prompt_tokens + 3 == len(plain_model.tokenizer.encode(prompt)) + 3


def test_usage_and_stats_in_responses(open_stack):
    url, _, _ = open_stack
    resp = oai(url).completions.create(model="plain", prompt="usage please", max_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 3
    assert resp.usage.prompt_tokens_details.cached_tokens == 0  # the dense engine has no prefix cache
    stats = resp.model_extra["stats"]
    assert stats["generated_tokens"] == 3 and stats["tier"] == "normal" and stats["attempts"] == 1
    assert stats["ttft_s"] is not None and stats["worker"]
    chunks = list(oai(url).completions.create(model="plain", prompt="usage please", max_tokens=3, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].model_extra["stats"]["generated_tokens"] == 3


def test_jobs_that_cannot_run_get_400_before_streaming(open_stack, tiny_model, redis_server):
    url, r, _ = open_stack
    client = oai(url)
    ctx = tiny_model.context_length
    long_prompt = " the" * (ctx + 10)  # ~ctx+10 tokens: too long, found by the gateway's exact count
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="plain", prompt=long_prompt, max_tokens=2, stream=stream)
        assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:  # ids outside the vocabulary
        client.completions.create(model="plain", prompt=[5, 10**6], max_tokens=2, stream=True)
    assert "vocabulary" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError):  # bad params
        client.completions.create(model="plain", prompt="x", max_tokens=2, stream=True, temperature=-1)
    # Refused by the worker only (a gateway that cannot read the model's tokenizer counts a lower
    # bound): still a 400, because a stream's headers wait for the job's first delta.
    gw_app = create_app(redis_server.url, fast_settings(redis_server.url))
    gw_app.state.gateway.token_names._cache[codec.unpack(r.hget(GK.models, "plain"))["source"]] = None
    with ServerThread(gw_app) as url2:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                oai(url2).completions.create(model="plain", prompt=long_prompt, max_tokens=2, stream=stream)
            assert err.value.body["code"] == "invalid_request" and "context" in err.value.body["message"]



def test_a_models_tokenizer_is_read_off_the_event_loop(open_stack, redis_server, plain_model):
    """The gateway reads a model's tokenizer.json (for prompt counts and logprob names) on a worker
    thread: on the event loop, a large one held every other request and stream of the gateway while
    it loaded. Here the load returns only once the gateway has answered another request meanwhile,
    which it can do only if the load is not running on its loop."""
    import threading

    from mlxq.producer.openai_api import TokenNames

    gw_app = create_app(redis_server.url, fast_settings(redis_server.url))
    names = gw_app.state.gateway.token_names
    loading, answered, seen = threading.Event(), threading.Event(), []

    def load(source: str):
        loading.set()
        seen.append(answered.wait(30))  # False after 30 s: the loop was blocked by this very load
        return TokenNames._load(source)

    names._load = load
    with ServerThread(gw_app) as url2:
        reply = []
        t = threading.Thread(target=lambda: reply.append(oai(url2).completions.create(
            model="plain", prompt="hello", max_tokens=2)))
        t.start()
        assert loading.wait(30)
        u = urlparse(url2)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("GET", "/health")
        if conn.getresponse().status == 200:
            answered.set()
        conn.close()
        t.join(60)
    assert seen == [True] and reply and reply[0].usage.prompt_tokens == len(plain_model.tokenizer.encode("hello"))
    assert names.tokenizer({"source": plain_model.source}) is not None
