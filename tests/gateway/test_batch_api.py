"""OpenAI's Batch API through the gateway, driven by the official ``openai`` client: a real Valkey,
one worker on the tiny model and one gateway for the module.  Every batch line's answer is compared
with the same request made directly through Chat Completions (greedy), or Embeddings, in the same run.
A batch that names a webhook gets its summary POSTed, signed, to a receiver on loopback when it ends.
The module's gateway keeps the files' bytes in a directory (``files_dir``); the second gateway of the
upload cap's test, and the fault tests (tests/faults/test_batch_failover.py), keep them in Redis."""

from __future__ import annotations

import contextlib
import json
import time

import openai
import pytest

from mlxq.producer.gateway import ServerThread, create_app
from mlxq.producer.gateway.batches import BatchLines
from mlxq.producer.webhooks import WebhookSender, new_secret
from mlxq.shared import apikeys
from mlxq.shared.keys import GlobalKeys
from mlxq.shared.settings import Settings
from hookkit import Receiver, receiving, verify
from workerkit import fast_settings, serving_gateway, wait_for

PROMPTS = ["Tell me about the sea.", "Name a colour.", "Count to three.", "Why is the sky blue?", "Hello!"]


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("files")


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model, files_dir):
    # the test's webhook receiver, on loopback; a completion window short enough to pass in the test
    settings = dict(webhook_hosts="127.0.0.1", webhook_private=True, completion_windows="24h,1s",
                    files_dir=str(files_dir))
    with serving_gateway(tiny_model, redis_server.url, settings, max_batch=8) as (url, r):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=60), r


def line(custom_id: str, prompt: str, model: str = "tiny", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6,
                     "temperature": 0, **body}}


def jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def upload(client: openai.OpenAI, lines: list):
    return client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")


def ended(client: openai.OpenAI, batch_id: str, timeout: float = 60.0):
    """The batch once it has ended (polled as a pipeline polls it)."""
    seen = {}
    assert wait_for(lambda: seen.update(b=client.batches.retrieve(batch_id)) or seen["b"].status in (
        "completed", "failed", "cancelled", "expired"), timeout=timeout, interval=0.05), seen
    return seen["b"]


def test_batch_answers_every_line_once_as_chat_completions_would(stack, files_dir):
    client, r = stack
    lines = [line(f"req-{i}", p, **({"logprobs": True, "top_logprobs": 2} if i == 1 else {}))
             for i, p in enumerate(PROMPTS)]
    f = upload(client, lines)
    assert f.object == "file" and f.purpose == "batch" and f.bytes == len(jsonl(lines))
    assert client.files.retrieve(f.id).filename == "requests.jsonl"
    # in files_dir under its id, written whole; Redis holds the file object only
    assert (files_dir / f.id).read_bytes() == jsonl(lines) and not r.hexists(GlobalKeys().file(f.id), "content")
    assert not [p for p in files_dir.iterdir() if p.name.startswith(".")]  # no temporary file left
    secret = new_secret()
    # signed with the secret of the creator's key (open mode: the token the client sends, as for its jobs)
    r.hset(GlobalKeys().webhook_secrets, apikeys.copy_field(apikeys.key_hash("EMPTY")), secret)
    with receiving([]) as hook:
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                      metadata={"run": "nightly"}, extra_body={"webhook": hook})
        check_answers(client, batch)
        # the webhook sender (mlxq webhooks run) posts the batch's summary once it has ended
        assert WebhookSender(r, Settings(webhook_hosts="127.0.0.1", webhook_private=True)).run_once() == 1
    [(headers, body)] = Receiver.got
    msg = json.loads(body)
    done = client.batches.retrieve(batch.id)
    assert verify(secret, headers, body) and headers["webhook-id"] == batch.id
    assert msg["type"] == "batch.completed" and msg["data"] == {
        "id": batch.id, "object": "batch", "status": "completed", "request_counts": {"total": 5, "completed": 5,
                                                                                     "failed": 0},
        "output_file_id": done.output_file_id, "error_file_id": None}
    assert (files_dir / done.output_file_id).exists()  # the output file too
    assert client.files.delete(done.output_file_id).deleted
    assert not (files_dir / done.output_file_id).exists() and not r.exists(GlobalKeys().file(done.output_file_id))


def check_answers(client: openai.OpenAI, batch) -> None:
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "nightly"}
    assert "webhook" not in batch.model_dump()  # (mlxq's own field: not in OpenAI's batch object)
    direct = {f"req-{i}": client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                                         max_tokens=6, temperature=0).choices[0].message.content
              for i, p in enumerate(PROMPTS)}
    done = ended(client, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 5, 0)
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(len(PROMPTS))]  # each once, in input order
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200 and o["id"].startswith("batch_req_")
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        assert body["choices"][0]["message"]["content"] == direct[o["custom_id"]]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert out[0]["response"]["body"]["choices"][0]["logprobs"] is None
    shown = out[1]["response"]["body"]["choices"][0]["logprobs"]["content"]  # named as the gateway names them
    assert "".join(t["token"] for t in shown) == direct["req-1"] and {len(t["top_logprobs"]) for t in shown} == {2}
    # behind interactive work, though the caller's tier is normal
    assert {o["response"]["body"]["stats"]["tier"] for o in out} == {"low"}

    listed = client.files.list(purpose="batch_output")
    assert [x.id for x in listed.data] == [done.output_file_id] and not listed.has_more
    f = batch.input_file_id
    assert f in [x.id for x in client.files.list()]
    assert client.files.delete(f).deleted
    assert f not in [x.id for x in client.files.list()]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f)


def test_a_bad_file_is_refused_naming_its_line(stack):
    client, r = stack
    before = r.dbsize()
    with pytest.raises(openai.BadRequestError, match="line 2: not a JSON object"):
        upload(client, [line("a", "hi"), "{not json", line("c", "hi")])
    with pytest.raises(openai.BadRequestError, match="line 3: custom_id 'a' is a duplicate of line 1"):
        upload(client, [line("a", "hi"), line("b", "hi"), line("a", "hi")])
    assert r.dbsize() == before  # nothing stored, nothing queued
    f = upload(client, [line("a", "hi"), line("b", "hi", model="no-such-model")])
    with pytest.raises(openai.BadRequestError, match="line 2: model 'no-such-model' is not served"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="line 1: url '/v1/chat/completions' is not the batch's"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="webhook host '10.1.2.3' is not allowed") as refused:
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                              extra_body={"webhook": "http://10.1.2.3/hook"})
    assert refused.value.body["param"] == "webhook"
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")


def embedding_line(custom_id: str, input, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "tiny", "input": input, **body}}


def test_an_embeddings_batch_answers_as_the_embeddings_endpoint_would(stack):
    client, _ = stack
    texts = PROMPTS[:3]
    f = upload(client, [embedding_line(f"e-{i}", t) for i, t in enumerate(texts)])
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    direct = [d.embedding for d in client.embeddings.create(model="tiny", input=texts, encoding_format="float").data]
    done = ended(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 3 and done.error_file_id is None
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == ["e-0", "e-1", "e-2"]
    for o, want in zip(out, direct):
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and body["object"] == "list" and body["model"] == "tiny"
        assert [d["embedding"] for d in body["data"]] == [want] and body["usage"]["prompt_tokens"] > 0

    many = upload(client, [embedding_line("a", "one"), embedding_line("b", ["two", "three"])])
    with pytest.raises(openai.BadRequestError, match="line 2: input holds 2 inputs: a batch line is one job"):
        client.batches.create(input_file_id=many.id, endpoint="/v1/embeddings", completion_window="24h")


def test_an_upload_over_the_cap_is_refused(stack, redis_server):
    _, r = stack
    before = set(r.keys("mlxq:file:*"))
    with ServerThread(create_app(redis_server.url, fast_settings(redis_server.url, max_file_bytes=300))) as url:
        small = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError, match="over the gateway's limit of 300 bytes") as info:
            upload(small, [line(f"x{i}", "hi") for i in range(3)])
        assert info.value.status_code == 413
        assert upload(small, [line("x", "hi")]).bytes < 300
    assert len(set(r.keys("mlxq:file:*")) - before) == 1  # the small one


@contextlib.contextmanager
def idle_model(r):
    """A model whose registry entry has no worker behind it: its lines stay queued."""
    r.hset(GlobalKeys().models, "idle", r.hget(GlobalKeys().models, "tiny"))
    try:
        yield
    finally:
        r.hdel(GlobalKeys().models, "idle")


def test_a_batch_past_its_window_expires_keeping_the_lines_answered(stack):
    client, r = stack
    meta = GlobalKeys().batch
    with idle_model(r):
        f = upload(client, [line("a", "hi"), line("b", "hi", model="idle"), line("c", "hi", model="idle")])
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert batch.expires_at == batch.created_at + 24 * 3600
        # line a answered, b and c queued: then the window is made to pass (as 24 h would)
        assert wait_for(lambda: r.hexists(meta(batch.id).results, 1) and r.hlen(meta(batch.id).jobs) == 3, timeout=30)
        jobs = {int(n): v.decode().split() for n, v in r.hgetall(meta(batch.id).jobs).items()}
        r.hset(meta(batch.id).meta, "expires_at", json.dumps(int(time.time()) - 1))
        done = ended(client, batch.id)
        # a window from the gateway's completion_windows: the driver expires it once it passes
        short = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1s")
        assert short.expires_at == short.created_at + 1
        brief = ended(client, short.id)
    assert done.status == "expired" and done.expired_at >= done.created_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 1, 2)
    [kept] = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert kept["custom_id"] == "a" and kept["response"]["status_code"] == 200
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in errors] == [("b", None, "batch_expired"),
                                                                                     ("c", None, "batch_expired")]
    for n in (2, 3):  # cancelled where they waited: never run
        model, job_id = jobs[n]
        assert r.hget(GlobalKeys().model_keys(model).job(job_id), "status") == b"cancelled"
    assert brief.status == "expired" and brief.request_counts.total == 3
    with pytest.raises(openai.BadRequestError, match="completion_window must be one of 24h, 1s, got '2h'"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="2h")


def test_cancel_and_list(stack):
    client, r = stack
    # an idle model's lines stay queued until the cancel
    with idle_model(r):
        f = upload(client, [line(f"q{i}", "hi", model="idle") for i in range(3)])
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert wait_for(lambda: r.hlen(GlobalKeys().batch(batch.id).jobs) == 3, timeout=30)
        assert client.batches.cancel(batch.id).status == "cancelling"
        done = ended(client, batch.id)
    assert done.status == "cancelled" and done.output_file_id is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 0, 3)
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert sorted(e["custom_id"] for e in errors) == ["q0", "q1", "q2"]
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"cancelled"}
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: a no-op
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_nope")

    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [batch.id] and page.has_more  # newest first
    rest = client.batches.list(limit=10, after=batch.id)
    assert batch.id not in [b.id for b in rest.data] and rest.data and not rest.has_more


def test_a_batch_over_its_creators_quota_waits_in_progress_until_the_reset(stack, monkeypatch, caplog):
    """The creator's daily tokens are used up: the batch stays in_progress with nothing queued, then runs
    to its end once the UTC day turns (made to turn here: today's usage count goes, as at midnight)."""
    client, r = stack
    monkeypatch.setattr(BatchLines, "QUOTA_RECHECK_S", 0.1)  # (asked again each 0.1 s, not each minute)
    gk, key = GlobalKeys(), "quota-key-0000001"
    apikeys.add_key(r, gk, key, "normal", name="bulk")
    try:
        apikeys.set_limits(r, gk, "bulk", daily_tokens=10)
        usage, day = gk.model_keys("tiny").usage, r.time()[0] // 86400
        today = f"{day}|{apikeys.copy_field(apikeys.key_hash(key))}|prompt"
        r.hset(usage, today, 10)  # (as complete.lua counts a job's tokens)
        keyed = openai.OpenAI(base_url=str(client.base_url), api_key=key, max_retries=0, timeout=60)
        f = upload(keyed, [line("q0", "hi"), line("q1", "hi")])
        with caplog.at_level("INFO", logger="mlxq.gateway"):
            batch = keyed.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
            assert wait_for(lambda: "daily token quota is used up" in caplog.text, timeout=30)
        waiting = keyed.batches.retrieve(batch.id)
        assert waiting.status == "in_progress" and waiting.request_counts.completed == 0
        assert r.hlen(gk.batch(batch.id).jobs) == 0  # nothing queued
        r.hdel(usage, today)  # the UTC day turns
        done = ended(keyed, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 2
    finally:
        apikeys.set_limits(r, gk, "bulk", daily_tokens=0)
        apikeys.revoke_name(r, gk, "bulk")  # (no key left: the module's gateway open again)
