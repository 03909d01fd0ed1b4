"""Completion webhooks (docs/pipelines/job-life.md) against a real Valkey and a receiver on loopback that
the test allows: the POST is signed as Standard Webhooks says (verified here from the rule, not with
mlxq's signing code), a receiver that fails once (500) gets the same message again, every attempt is
recorded, and a URL off the allowlist or on a private address is refused at submit."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
import redis

from mlxq import AsyncClient, Client
from mlxq.cli import main
from mlxq.producer import webhooks
from mlxq.producer.webhooks import WebhookRefused, WebhookSender, check_url, deliveries
from mlxq.shared import apikeys
from mlxq.shared.keys import GlobalKeys, ModelKeys
from hookkit import Receiver, receiving, verify
from workerkit import fast_settings, wait_for


@pytest.fixture
def receiver():
    with receiving([500]) as url:
        yield url


def test_a_signed_webhook_is_delivered_after_the_receiver_fails_once(redis_url, receiver, monkeypatch, capsys,
                                                                     tmp_path):
    monkeypatch.setattr(webhooks, "FIRST_RETRY_S", 0.01)  # the retry's backoff, drawn with jitter below it
    r = redis.Redis.from_url(redis_url)
    settings = fast_settings(redis_url, webhook_hosts="127.0.0.1", webhook_private=True)
    assert main(["keys", "webhook-secret", "--anonymous", "--redis-url", redis_url]) == 0  # an admin makes it
    secret = capsys.readouterr().out.strip()
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[len("whsec_"):])) == 24
    client = Client(redis_url, model="tiny", settings=settings)
    try:
        # no worker: the job ends by a cancel, which is an end the webhook reports as any other
        job = client.submit("hi", max_tokens=2, webhook=receiver)
        assert job.cancel() == "cancelled"
        sender = WebhookSender(r, settings, models=["tiny"])
        assert sender.run_once() == 0 and len(Receiver.got) == 1  # the 500
        (first,) = deliveries(r, ModelKeys("tiny"))
        assert first["state"] == "retrying" and first["attempts"] == 1 and first["last"] == "HTTP 500"
        assert wait_for(lambda: sender.run_once() == 1, timeout=30)
    finally:
        client.close()
    assert len(Receiver.got) == 2
    (_, body1), (headers, body) = Receiver.got
    assert body == body1 or json.loads(body)["data"] == json.loads(body1)["data"]
    assert all(h["webhook-id"] == job.id for h, _ in Receiver.got)  # the receiver's de-duplication key
    assert all(verify(secret, h, b) for h, b in Receiver.got)
    assert not verify(webhooks.new_secret(), headers, body)
    msg = json.loads(body)
    assert msg["type"] == "job.cancelled" and msg["data"]["id"] == job.id and msg["data"]["status"] == "cancelled"
    (done,) = deliveries(r, ModelKeys("tiny"))
    assert done["state"] == "delivered" and done["attempts"] == 2 and done["url"] == receiver
    assert r.zcard(ModelKeys("tiny").webhooks) == 0
    assert sender.run_once() == 0 and len(Receiver.got) == 2  # delivered once: never again
    assert main(["webhooks", "list", "--queue", "tiny", "--json", "--redis-url", redis_url]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["job"] == job.id and listed["state"] == "delivered" and listed["attempts"] == 2
    # a key's own secret: set by name, under the field the job records (whk)
    apikeys.add_key(r, GlobalKeys().api_keys, "ingest-key-0001", "low", name="ingest")
    assert main(["keys", "webhook-secret", "--name", "ingest", "--redis-url", redis_url]) == 0
    field = apikeys.copy_field(apikeys.key_hash("ingest-key-0001"))
    ingest_secret = capsys.readouterr().out.strip()
    assert r.hget(GlobalKeys().webhook_secrets, field).decode() == ingest_secret
    with Client(redis_url, api_key="ingest-key-0001", model="tiny", settings=settings) as keyed:
        job = keyed.submit("hi", max_tokens=2, webhook=receiver)
        assert job.cancel() == "cancelled"
    assert sender.run_once() == 1
    headers, body = Receiver.got[-1]
    assert headers["webhook-id"] == job.id and verify(ingest_secret, headers, body) and not verify(secret, headers, body)
    with pytest.raises(ValueError, match="no key named"):
        apikeys.set_webhook_secret(r, GlobalKeys(), "nobody", "whsec_x")
    # Client.map: one webhook for the whole run when it ends, signed with the run's key's secret, sent by
    # the same sender (the one item here is invalid: the run ends with nothing queued)
    with Client(redis_url, api_key="ingest-key-0001", model="tiny", settings=settings) as keyed:
        with pytest.raises(WebhookRefused, match="not allowed"):
            next(keyed.map(["hi"], webhook="https://evil.example.net/hook"))
        [res] = keyed.map([{"prompt": "hi", "max_tokens": -1}], webhook=receiver)
    assert res.finish_reason == "error" and sender.run_once() == 0  # a sender of one model leaves runs be
    assert WebhookSender(r, settings).run_once() == 1
    headers, body = Receiver.got[-1]
    msg = json.loads(body)
    assert msg["type"] == "map.completed" and msg["data"]["request_counts"] == {"total": 1, "completed": 0,
                                                                                 "failed": 1}
    assert headers["webhook-id"] == msg["data"]["id"] and verify(ingest_secret, headers, body)
    assert main(["webhooks", "list", "--json", "--redis-url", redis_url]) == 0
    [run] = [row for row in json.loads(capsys.readouterr().out) if row["model"] == "-"]
    assert run["job"] == msg["data"]["id"] and run["state"] == "delivered" and "body" not in run
    # mlxq batch --webhook: one bulk.completed once every line is in the output (its line refused here)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"prompt": "hi", "max_tokens": -1}\n')
    monkeypatch.setenv("MLXQ_WEBHOOK_HOSTS", "127.0.0.1")
    monkeypatch.setenv("MLXQ_WEBHOOK_PRIVATE", "1")
    monkeypatch.setenv("MLXQ_API_KEY", "ingest-key-0001")
    assert main(["batch", str(src), "-o", str(out), "--redis-url", redis_url, "--queue", "tiny", "-q",
                 "--webhook", receiver]) == 0
    assert WebhookSender(r, settings).run_once() == 1
    headers, body = Receiver.got[-1]
    msg = json.loads(body)["data"]
    assert json.loads(body)["type"] == "bulk.completed" and verify(ingest_secret, headers, body)
    assert msg["request_counts"] == {"total": 1, "completed": 0, "failed": 1} and msg["output"] == "out.jsonl"
    r.close()


def test_webhook_urls_off_the_allowlist_or_on_private_addresses_are_refused(redis_url):
    settings = fast_settings(redis_url, webhook_hosts="127.0.0.1,hooks.example.com,10.1.2.3")
    client = Client(redis_url, model="tiny", settings=settings)
    try:
        with pytest.raises(WebhookRefused, match="loopback, private or reserved"):
            client.submit("hi", max_tokens=2, webhook="http://127.0.0.1:8080/hook")
        with pytest.raises(WebhookRefused, match="not allowed"):
            client.submit("hi", max_tokens=2, webhook="https://evil.example.net/hook")
    finally:
        client.close()

    async def submit_async():  # AsyncClient: the same check (the host resolved off the event loop)
        async with AsyncClient(redis_url, model="tiny", settings=settings) as aclient:
            with pytest.raises(WebhookRefused, match="loopback, private or reserved"):
                await aclient.submit("hi", max_tokens=2, webhook="http://127.0.0.1:8080/hook")
            with pytest.raises(ValueError, match="already past"):
                await aclient.submit("hi", max_tokens=2, expires_in=0, run_at=None, expires_at=None)
            with pytest.raises(WebhookRefused, match="loopback, private or reserved"):
                [x async for x in aclient.map(["hi"], webhook="http://127.0.0.1:8080/hook")]
        loopback = fast_settings(redis_url, webhook_hosts="127.0.0.1", webhook_private=True)
        async with AsyncClient(redis_url, model="tiny", settings=loopback) as aclient:  # a run's end queued
            [res] = [x async for x in aclient.map([{"prompt": "hi", "max_tokens": -1}], webhook="http://127.0.0.1/h")]
        return res

    assert asyncio.run(submit_async()).finish_reason == "error"
    with redis.Redis.from_url(redis_url) as r:
        [queued] = [json.loads(v) for v in r.hvals(GlobalKeys().bulk_webhook_log)]
    assert queued["state"] == "pending" and queued["body"]["type"] == "map.completed"
    with pytest.raises(WebhookRefused, match="10.1.2.3"):
        check_url("http://10.1.2.3/hook", settings)
    # an allowed name that resolves to a private address (a DNS record pointing inside): refused too
    private_dns = lambda *a, **k: [(2, 1, 6, "", ("192.168.1.9", 443))]  # noqa: E731
    with pytest.raises(WebhookRefused, match="192.168.1.9"):
        check_url("https://hooks.example.com/x", settings, resolve=private_dns)
    check_url("https://hooks.example.com/x", settings, resolve=lambda *a, **k: [(2, 1, 6, "", ("93.184.215.14", 443))])
    for bad in ("ftp://hooks.example.com/x", "https://user:pw@hooks.example.com/x", "not a url"):
        with pytest.raises(WebhookRefused):
            check_url(bad, settings)
    with pytest.raises(WebhookRefused, match="none"):
        check_url("https://hooks.example.com/x", fast_settings(redis_url))
