"""Bulk submission: ``Client.map`` and ``AsyncClient.map`` keep input order; ``mlxq batch`` resumes without
duplicates."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading

import jsonschema
import pytest
import redis

from mlxq import AsyncClient, Client
from mlxq.producer.bulk import BatchRun
from mlxq.cli import main as mlxq_main
from mlxq.shared.constraints import ModelFormat
from mlxq.shared.keys import GlobalKeys
from workerkit import fast_settings, job_fields, running_worker, wait_for
from refkit import greedy

KEYS = GlobalKeys().model_keys("tiny")
CMPL_PROMPT = "A recipe for bread starts with"


def test_client_map_yields_results_in_input_order(tiny_model, redis_url):
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    items = [{"prompt": f"item {i}", "max_tokens": i + 1} for i in range(7)]
    items.insert(3, {"prompt": "bad", "max_tokens": 0})  # invalid: an error Result in its place
    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        results = list(client.map(items, ignore_eos=True, window=3, timeout=30))
    assert len(results) == 8
    assert results[3].finish_reason == "error" and "invalid request" in results[3].error
    good = results[:3] + results[4:]
    assert [r.stats.generated_tokens for r in good] == [1, 2, 3, 4, 5, 6, 7]  # order kept
    assert {job_fields(client.redis, KEYS.job(r.id))["tier"] for r in good} == {b"low"}


def test_async_client_map_gives_what_client_map_gives(tiny_model, redis_url):
    """``AsyncClient.map`` runs the same core as ``Client.map``: the same items give Results of the same
    shape in the same order (an invalid item an error Result in its place), submitted at the low tier."""
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    items = [{"prompt": f"item {i}", "max_tokens": i + 1} for i in range(5)]
    items.insert(2, {"prompt": "bad", "max_tokens": 0})

    async def amap() -> list:
        async with AsyncClient(redis_url, model="tiny", settings=settings) as aclient:
            return [res async for res in aclient.map(items, ignore_eos=True, window=3, timeout=30)]

    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        want = list(client.map(items, ignore_eos=True, window=3, timeout=30))
        got = asyncio.run(amap())
    shape = [(r.finish_reason, r.error, r.stats.generated_tokens if r.stats else None) for r in want]
    assert [(r.finish_reason, r.error, r.stats.generated_tokens if r.stats else None) for r in got] == shape
    assert got[2].finish_reason == "error" and [r.stats.generated_tokens for r in got if r.id] == [1, 2, 3, 4, 5]
    assert {job_fields(client.redis, KEYS.job(r.id))["tier"] for r in got if r.id} == {b"low"}
    client.close()


def test_both_clients_have_the_same_methods_and_name_the_same_model(redis_url):
    """The same public names on both clients (close is aclose; queue_for is the sync transport, at and
    calls the async one); ``await aclient.model`` is ``client.model``, and the coroutine it was
    (``await aclient.model()``) still works, with a DeprecationWarning."""
    from mlxq.producer.aclient import AsyncJob
    from mlxq.producer.client import Job

    def public(cls) -> set:
        return {n for n in dir(cls) if not n.startswith("_")}

    assert public(Client) - {"close", "queue_for"} == public(AsyncClient) - {"aclose", "at", "calls"}
    assert public(Job) == public(AsyncJob)
    client = Client(redis_url, api_key="k-123456789", settings=fast_settings(redis_url, model="tiny"))

    async def run() -> None:
        async with AsyncClient(redis_url, api_key="k-123456789", settings=fast_settings(redis_url, model="tiny")) as aclient:
            assert await aclient.model == client.model == "tiny"
            with pytest.warns(DeprecationWarning, match="await client.model"):
                assert await aclient.model() == "tiny"
            assert aclient.key_hash == client.key_hash

    asyncio.run(run())
    client.close()


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_resumes_after_interruption_without_duplicates(tiny_model, redis_url, tmp_path, capsys):
    n = 10
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"prompt": f"doc {i}", "max_tokens": 20 + i, "custom_id": f"c{i}"}) for i in range(n)]
    src.write_text("\n".join(lines) + "\n")
    settings = fast_settings(redis_url)
    r = redis.Redis.from_url(redis_url)
    with running_worker(tiny_model, redis_url, settings, max_batch=1):
        client = Client(redis_url, model="tiny", settings=settings)
        stop = threading.Event()
        first: dict = {}
        # the run's options as the rerun's command line gives them (none): a line's key holds them
        t = threading.Thread(target=lambda: first.setdefault("s", BatchRun(
            client, str(src), str(out), window=2, poll_s=0.005, progress=False, stop=stop).run()))
        t.start()
        assert wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= 3, timeout=30, interval=0.002)
        stop.set()  # interrupted: up to `window` jobs stay queued, later lines were never submitted
        t.join(timeout=10)
        done_first = len(_records(out))
        with out.open("a") as f:
            f.write('{"line": 99, "torn')  # a write cut off by the interruption
        # the rerun, through the CLI
        rc = mlxq_main(["batch", str(src), "-o", str(out), "--redis-url", redis_url, "--model", "tiny", "-q"])
        assert rc == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    records = _records(out)
    assert sorted(rec["line"] for rec in records) == list(range(1, n + 1))  # each line exactly once
    assert done_first >= 3 and first["s"].written == done_first and first["s"].interrupted
    assert summary["skipped"] == done_first and summary["written"] == n - done_first
    assert summary["duplicates"] >= 1  # jobs queued before the interruption were waited for, not re-run
    for rec in records:
        i = rec["line"] - 1
        assert rec["custom_id"] == f"c{i}" and rec["error"] is None
        assert rec["response"]["status_code"] == 200 and rec["response"]["request_id"] == rec["id"]
        body = rec["response"]["body"]
        assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] in ("stop", "length")
        if body["choices"][0]["finish_reason"] == "length":
            assert body["usage"]["completion_tokens"] == 20 + i
    # no line was enqueued twice: the rerun found the still-queued jobs by their idempotency keys
    assert int(r.hget(KEYS.counts, "submitted")) == n
    r.close()


def worker_only_too_long(loaded) -> str:
    """A prompt with more tokens than the model's context (counted here with its own tokenizer) that the
    producer's lower bound (bytes / the longest token's bytes) lets through."""
    ctx = loaded.context_length
    prompt = " ".join(str(i % 10) for i in range(ctx + 8))
    assert len(loaded.tokenizer.encode(prompt)) > ctx and len(prompt.encode()) // loaded.max_token_bytes < ctx
    return prompt


def test_batch_lines_follow_the_openai_batch_format(tiny_model, redis_url, tmp_path):
    """OpenAI Batch request lines are accepted as they are; every output line is an OpenAI Batch output
    line ({"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}) plus ``line``."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                  "ignore_eos": True}},
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": CMPL_PROMPT, "max_tokens": 3}},
        {"custom_id": "plain-1", "prompt": "hello", "max_tokens": 2, "ignore_eos": True},
        {"custom_id": "bad-1", "prompt": "hello", "max_tokens": 0},
        {"custom_id": "bad-2", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["x", "y"]}},
        {"custom_id": "emb-1", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hello", "dimensions": 8}},
        {"custom_id": "long-1", "prompt_tokens": [5] * (tiny_model.context_length + 1), "max_tokens": 2},
        # longer than the context, though not by the producer's lower bound: only the worker finds out
        {"custom_id": "long-2", "prompt": worker_only_too_long(tiny_model), "max_tokens": 2},
    ]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    settings = fast_settings(redis_url)
    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        client = Client(redis_url, model="tiny", settings=settings)
        assert wait_for(lambda: "tiny" in client.models(), timeout=10)  # so the context check runs up front
        summary = BatchRun(client, str(src), str(out), progress=False).run()
        direct = client.embed("hello", dimensions=8)
    assert summary.written == len(lines)
    recs = {rec["custom_id"]: rec for rec in _records(out)}
    emb = recs["emb-1"]["response"]["body"]
    assert emb["object"] == "list" and [d["embedding"] for d in emb["data"]] == [direct]
    assert "one input" in recs["bad-2"]["error"]["message"]
    for rec in recs.values():
        assert set(rec) == {"id", "custom_id", "line", "response", "error"}
    chat = recs["chat-1"]["response"]
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"
    assert chat["body"]["choices"][0]["finish_reason"] == "length"
    assert chat["body"]["usage"]["completion_tokens"] == 3 and chat["body"]["stats"]["tier"] == "low"
    cmpl = recs["cmpl-1"]["response"]["body"]
    ref, ref_text = greedy(tiny_model, CMPL_PROMPT, 3)  # mlx-lm on this run's weights
    assert cmpl["object"] == "text_completion" and cmpl["choices"][0]["text"] == ref_text
    assert cmpl["choices"][0]["finish_reason"] == ("length" if len(ref) == 3 else "stop")
    assert cmpl["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert recs["plain-1"]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    for bad in ("bad-1", "bad-2", "long-1"):  # never submitted: refused up front
        assert recs[bad]["response"] is None and recs[bad]["error"]["code"] == "invalid_request", bad
    assert recs["bad-1"]["line"] == 4
    long2 = recs["long-2"]["response"]
    assert long2["status_code"] == 400 and "context" in long2["body"]["error"]["message"]
    assert recs["long-2"]["error"] is None


# -- structured output in bulk ----------------------------------------------------------------------
# an extraction schema (an enum, integer bounds, a nested object, an array), with lengths bounded so
# that every valid output ends well within BULK_MAX_TOKENS whatever the weights say
DOC = {"type": "object", "additionalProperties": False, "required": ["kind", "pages", "meta"],
       "properties": {"kind": {"enum": ["invoice", "letter", "report"]},
                      "pages": {"type": "integer", "minimum": 1, "maximum": 500},
                      "meta": {"type": "object", "additionalProperties": False, "required": ["lang"],
                               "properties": {"lang": {"enum": ["en", "fr", "de"]},
                                              "keywords": {"type": "array", "maxItems": 2,
                                                           "items": {"type": "string", "maxLength": 5}}}}}}
DOC_FORMAT = {"type": "json_schema", "json_schema": {"name": "doc", "schema": DOC}}
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}
CODE = r"[A-Z]{2}[0-9]{3}"
BULK_MAX_TOKENS = 300


def no_thinking(loaded) -> dict[int, float]:
    """Keep a model with a reasoning block from opening it (see test_cli_structured.no_thinking)."""
    return {i: -100.0 for i in ModelFormat.from_tokenizer(loaded.tokenizer).think_start_ids[:1]}

NOT_A_SCHEMA = {"type": "object", "properties": {"pages": {"type": "integr"}}}
BAD_FORMATS = ({"type": "json_schema", "json_schema": {"name": "doc", "schema": NOT_A_SCHEMA}},
               {"type": "regex", "pattern": "[0-9"},
               {"type": "choice", "choices": []})

def test_map_with_a_run_wide_schema_and_per_item_overrides(tiny_model, redis_url):
    """Every item runs under the run-wide schema unless it sets its own response_format; sampled, so only
    the constraint makes the outputs valid.  A bad run-wide constraint raises before anything is queued."""
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    items = [{"prompt": f"Ticket {i}:", "seed": i} for i in range(8)]
    items.append({"prompt": "Language:", "seed": 8, "response_format": {"type": "choice", "choices": ["en", "fr"]}})
    items.append({"prompt": "Free:", "max_tokens": 3, "ignore_eos": True, "response_format": {"type": "text"}})
    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        results = list(client.map(items, response_format=DOC_FORMAT, temperature=1.0, max_tokens=BULK_MAX_TOKENS,
                                  logit_bias=no_thinking(tiny_model),
                                  timeout=120))
        for fmt in BAD_FORMATS:
            with pytest.raises(ValueError, match="nothing was queued"):
                next(client.map(["a", "b"], response_format=fmt))
    assert [r.finish_reason for r in results[:9]] == ["stop"] * 9, [(r.finish_reason, r.error) for r in results]
    for res in results[:8]:
        jsonschema.validate(json.loads(res.text), DOC)
    assert results[8].text in ("en", "fr")
    assert results[9].stats.generated_tokens == 3  # free: no constraint
    assert int(client.redis.hget(KEYS.counts, "submitted")) == len(items)


def test_batch_with_a_schema_validates_every_line_and_reports_a_bad_line_on_its_line(
        tiny_model, redis_url, tmp_path, capsys):
    """``mlxq batch --json-schema FILE``: lines run under it unless they set their own response_format (a
    plain line or an OpenAI Batch line); a line whose own constraint is bad is reported on that line while
    the others run.  A bad run-wide schema refuses the whole run: nothing queued, no output written."""
    schema_file, src, out = tmp_path / "doc.json", tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    schema_file.write_text(json.dumps(DOC))
    lines = [{"custom_id": f"doc-{i}", "prompt": f"Document {i}:", "seed": i} for i in range(6)]
    lines.insert(2, {"custom_id": "own-regex", "prompt": "Code:", "seed": 9,
                     "response_format": {"type": "regex", "pattern": CODE}})
    lines.insert(4, {"custom_id": "bad-regex", "prompt": "Code:", "response_format": BAD_FORMATS[1]})
    lines.append({"custom_id": "openai-line", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "tiny", "messages": [{"role": "user", "content": "Triage:"}], "seed": 7,
                           "logit_bias": {str(i): b for i, b in no_thinking(tiny_model).items()},  # OpenAI's str keys
                           "temperature": 1.0, "max_tokens": BULK_MAX_TOKENS,
                           "response_format": {"type": "json_schema",
                                               "json_schema": {"name": "verdict", "schema": VERDICT}}}})
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    settings = fast_settings(redis_url)
    r = redis.Redis.from_url(redis_url)
    argv = ["batch", str(src), "--redis-url", redis_url, "--model", "tiny", "-q", "--temperature", "1.0",
            "--max-tokens", str(BULK_MAX_TOKENS)] + [a for i in no_thinking(tiny_model) for a in ("--logit-bias", f"{i}=-100")]
    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        assert mlxq_main([*argv, "-o", str(out), "--json-schema", str(schema_file)]) == 0
        capsys.readouterr()
        submitted = int(r.hget(KEYS.counts, "submitted"))
        schema_file.write_text(json.dumps(NOT_A_SCHEMA))
        refused = tmp_path / "refused.jsonl"
        assert mlxq_main([*argv, "-o", str(refused), "--json-schema", str(schema_file)]) == 2
        err = capsys.readouterr().err
        assert "nothing was queued" in err and not refused.exists(), err
        assert int(r.hget(KEYS.counts, "submitted")) == submitted
    recs = {rec["custom_id"]: rec for rec in _records(out)}
    assert len(recs) == len(lines) and submitted == len(lines) - 1
    bad_rec = recs.pop("bad-regex")
    assert bad_rec["line"] == 5 and bad_rec["response"] is None and bad_rec["error"]["code"] == "invalid_request"
    assert "regex" in bad_rec["error"]["message"], bad_rec
    for cid, rec in recs.items():
        body = rec["response"]["body"]
        assert rec["response"]["status_code"] == 200 and body["choices"][0]["finish_reason"] == "stop", (cid, body)
        choice = body["choices"][0]
        text = choice["message"]["content"] if cid == "openai-line" else choice["text"]
        if cid == "own-regex":
            assert re.fullmatch(CODE, text), text
        elif cid == "openai-line":  # the body's own response_format (the gateway's request model reads it)
            jsonschema.validate(json.loads(text), VERDICT)
        else:
            jsonschema.validate(json.loads(text), DOC)


def test_the_gateways_batch_endpoint_takes_a_response_format(tiny_model, redis_url):
    """``/v1/batch/chat/completions`` (the low tier) takes the same fields as a batch line: the official
    ``openai`` client's ``response_format`` gives JSON valid for the schema, at the low tier; a bad schema
    is a 400 and nothing is queued."""
    import openai

    from mlxq.producer.gateway import ServerThread, create_app

    settings = fast_settings(redis_url)
    r = redis.Redis.from_url(redis_url)
    bias = {str(i): b for i, b in no_thinking(tiny_model).items()}
    with running_worker(tiny_model, redis_url, settings, max_batch=4), \
            ServerThread(create_app(redis_url, settings)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1/batch", api_key="EMPTY")
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Document:"}], max_tokens=BULK_MAX_TOKENS,
            temperature=1.0, seed=3, logit_bias=bias, response_format=DOC_FORMAT)
        assert reply.choices[0].finish_reason == "stop", reply
        jsonschema.validate(json.loads(reply.choices[0].message.content), DOC)
        assert reply.model_extra["stats"]["tier"] == "low"
        queued = int(r.hget(KEYS.counts, "submitted"))
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                           response_format=BAD_FORMATS[0])
        assert int(r.hget(KEYS.counts, "submitted")) == queued
    r.close()


def test_batch_lines_carry_the_logprobs_the_gateway_would_return(tiny_model, redis_url, tmp_path):
    """A line that asks for logprobs (a chat line's ``logprobs``/``top_logprobs``, a completion line's
    ``logprobs: k``, a plain line's ``logprobs: k``) gets them in OpenAI's shape, with the token texts of
    the model's tokenizer (readable here, as for the gateway); a line that does not gets null."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"custom_id": "chat-lp", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                  "ignore_eos": True, "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "chat-lp0", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                  "ignore_eos": True, "logprobs": True}},
        {"custom_id": "cmpl-lp", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": CMPL_PROMPT, "max_tokens": 4, "ignore_eos": True, "logprobs": 3}},
        {"custom_id": "plain-lp", "prompt": CMPL_PROMPT, "max_tokens": 4, "ignore_eos": True, "logprobs": 2},
        {"custom_id": "chat-none", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}},
        {"custom_id": "plain-none", "prompt": CMPL_PROMPT, "max_tokens": 2},
    ]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    settings = fast_settings(redis_url)
    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        client = Client(redis_url, model="tiny", settings=settings)
        assert wait_for(lambda: "tiny" in client.models(), timeout=10)
        summary = BatchRun(client, str(src), str(out), progress=False).run()
    assert summary.written == len(lines)
    recs = {rec["custom_id"]: rec["response"]["body"] for rec in _records(out)}
    for cid, top_n in (("chat-lp", 2), ("chat-lp0", 0)):
        body = recs[cid]
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == body["usage"]["completion_tokens"] == 4, cid
        # every token is named, markers included: the answer (the text outside a thought the model may
        # open) is within what they spell
        assert body["choices"][0]["message"]["content"] in "".join(c["token"] for c in content) or any(
            "\ufffd" in c["token"] for c in content), cid
        for c in content:
            assert c["logprob"] <= 0 and c["bytes"] == list(c["token"].encode())
            assert len(c["top_logprobs"]) == top_n and not re.fullmatch(r"<\d+>", c["token"])  # a text, not an id
            assert all(t["logprob"] <= 0 and t["bytes"] == list(t["token"].encode()) for t in c["top_logprobs"])
    for cid, top_n in (("cmpl-lp", 3), ("plain-lp", 2)):
        body = recs[cid]
        lp = body["choices"][0]["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == body["usage"]["completion_tokens"] == 4, cid
        # keyed by token text (OpenAI's completions shape): alternatives that are bytes of one UTF-8
        # character are all named "\ufffd" and count once, so an entry may hold fewer, for some weights
        assert all(len(t) == top_n or (0 < len(t) < top_n and "\ufffd" in t) for t in lp["top_logprobs"]), \
            (cid, json.dumps(lp["top_logprobs"]))
        assert not any(re.fullmatch(r"<\d+>", t) for t in lp["tokens"])
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(4)]
        assert "".join(lp["tokens"]) == body["choices"][0]["text"] or any("\ufffd" in t for t in lp["tokens"]), cid
    # greedy: the same prompt and length give the same tokens, named by the model's tokenizer
    assert recs["cmpl-lp"]["choices"][0]["logprobs"]["tokens"] == recs["plain-lp"]["choices"][0]["logprobs"]["tokens"]
    assert recs["chat-lp"]["choices"][0]["logprobs"]["content"][0]["token"] == \
        recs["chat-lp0"]["choices"][0]["logprobs"]["content"][0]["token"]
    assert recs["chat-none"]["choices"][0]["logprobs"] is None
    assert recs["plain-none"]["choices"][0]["logprobs"] is None


def test_batch_max_tokens_fills_in_for_completion_lines_that_do_not_set_it(tiny_model, redis_url, tmp_path, capsys):
    """``mlxq batch --max-tokens N`` is the max_tokens of every line that does not set its own, an OpenAI
    /v1/completions line too (whose request model defaults to 16); without the flag that line gets 16."""
    src, out, out16 = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "out16.jsonl"
    cmpl = {"method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": CMPL_PROMPT, "ignore_eos": True}}
    lines = [{"custom_id": "cmpl-default", **cmpl},
             {"custom_id": "cmpl-own", **cmpl, "body": {**cmpl["body"], "max_tokens": 3}},
             {"custom_id": "chat-default", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}},
             {"custom_id": "plain-default", "prompt": CMPL_PROMPT, "ignore_eos": True}]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    settings = fast_settings(redis_url)
    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        assert mlxq_main(["batch", str(src), "-o", str(out), "--redis-url", redis_url, "--model", "tiny", "-q",
                          "--max-tokens", "5"]) == 0
        client = Client(redis_url, model="tiny", settings=settings)
        src16 = tmp_path / "in16.jsonl"
        src16.write_text(json.dumps(lines[0]) + "\n")
        BatchRun(client, str(src16), str(out16), progress=False).run()
    capsys.readouterr()
    got = {rec["custom_id"]: rec["response"]["body"]["usage"]["completion_tokens"] for rec in _records(out)}
    assert got == {"cmpl-default": 5, "cmpl-own": 3, "chat-default": 5, "plain-default": 5}
    assert _records(out16)[0]["response"]["body"]["usage"]["completion_tokens"] == 16  # the endpoint's default


def test_batch_runs_again_with_other_options_and_refuses_what_would_wait_forever(tiny_model, redis_url, tmp_path):
    """A rerun of one input with other options runs every line anew (it got the earlier run's
    results: a line's key held only the file); a line naming a model no worker registered is refused
    on its line (it was queued for nobody and the run never ended); a line that is not UTF-8 is
    refused alone (it ended the run before anything was queued); an explicit null in a Batch body
    turns a run-wide constraint off for that line; a window under 1 is refused."""
    from mlxq.producer.bulk import _line_params

    src = tmp_path / "in.jsonl"
    good = json.dumps({"custom_id": "g", "prompt": "hello", "ignore_eos": True}).encode()
    ghost = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions",
                        "body": {"model": "gpt-4o-mini", "prompt": "hello", "max_tokens": 4}}).encode()
    src.write_bytes(good + b"\n" + ghost + b"\n" + b'{"prompt": "caf\xe9"}\n')
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    with running_worker(tiny_model, redis_url, settings, max_batch=2):
        assert wait_for(lambda: "tiny" in client.models(), timeout=60)  # a registry that names the models
        runs = []
        for k, max_tokens in enumerate((2, 5)):
            out = tmp_path / f"out{k}.jsonl"
            runs.append((BatchRun(client, str(src), str(out), progress=False, max_tokens=max_tokens).run(),
                         {rec["line"]: rec for rec in _records(out)}))
    for (summary, recs), max_tokens in zip(runs, (2, 5)):
        assert summary.duplicates == 0 and not summary.interrupted and sorted(recs) == [1, 2, 3]
        assert recs[1]["response"]["body"]["usage"]["completion_tokens"] == max_tokens
        assert recs[2]["response"] is None and "gpt-4o-mini" in recs[2]["error"]["message"]
        assert recs[3]["response"] is None and "invalid request" in recs[3]["error"]["message"]
    body = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "x", "response_format": None, "max_tokens": 4}}
    params, fallback, *_ = _line_params(body)
    assert {**fallback, "response_format": {"type": "regex", "pattern": "[0-9]+"}, **params}["response_format"] is None
    with pytest.raises(ValueError, match="window"):
        BatchRun(client, str(src), str(tmp_path / "o.jsonl"), window=0)
    with pytest.raises(ValueError, match="window"):
        list(client.map(["a"], window=0))


def test_a_cancelled_line_is_an_error_and_a_map_left_early_cancels_its_queued_jobs(redis_url, tmp_path):
    """No worker serves "tiny" here: jobs stay queued. A line whose job is cancelled is written as an
    error (it was a 200 with no text); map() left before its end cancels the jobs it had queued, which
    nobody could find again without an idempotency_prefix."""
    from mlxq import JobTimeout

    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    r = redis.Redis.from_url(redis_url)
    before = set(r.zrange(KEYS.queue, 0, -1))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('"a"\n')
    done: dict = {}
    t = threading.Thread(target=lambda: done.setdefault("s", BatchRun(client, str(src), str(out), progress=False,
                                                                       poll_s=0.01).run()))
    t.start()
    assert wait_for(lambda: set(r.zrange(KEYS.queue, 0, -1)) - before, timeout=10)
    (job_id,) = [m.decode() for m in set(r.zrange(KEYS.queue, 0, -1)) - before]
    client.job(job_id).cancel()
    t.join(timeout=30)
    (rec,) = _records(out)
    assert rec["response"]["status_code"] == 500 and rec["response"]["body"]["error"]["code"] == "cancelled"
    def cancelled() -> int:
        return sum(r.hget(k, "status") == b"cancelled" for k in r.scan_iter(match=KEYS.job("*")) if r.type(k) == b"hash")

    was = cancelled()
    results = client.map([f"p{i}" for i in range(6)], window=4, timeout=0.3)
    with pytest.raises(JobTimeout):  # the first job never ends: the map stops with its 4 jobs queued
        next(results)
    assert cancelled() == was + 4 and set(r.zrange(KEYS.queue, 0, -1)) <= before

    async def amap() -> None:  # AsyncClient.map: the same, once the iterator is closed
        async with AsyncClient(redis_url, model="tiny", settings=settings) as aclient:
            async with contextlib.aclosing(aclient.map([f"p{i}" for i in range(6)], window=4, timeout=0.3)) as res:
                with pytest.raises(JobTimeout):
                    await anext(res)

    asyncio.run(amap())
    assert cancelled() == was + 8 and set(r.zrange(KEYS.queue, 0, -1)) <= before
    r.close()


def test_batch_command_line_errors_are_one_line(tmp_path, capsys):
    """A missing input file and a window under 1: a one-line error and a non-zero exit, no traceback."""
    rc = mlxq_main(["batch", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl"),
                    "--redis-url", "redis://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and "FileNotFoundError" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:
        mlxq_main(["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--window", "0"])
    assert exit_.value.code == 2 and "must be at least 1" in capsys.readouterr().err
