"""A daily token quota per API key, without a worker: usage as complete.lua counts it, then a refusal
with the time to the next UTC day through Client, AsyncClient and the gateway (429, Retry-After, OpenAI's
``insufficient_quota`` error)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mlxq import AsyncClient, Client, QuotaExceeded
from mlxq.producer import bulkmap
from mlxq.shared import apikeys
from mlxq.shared.keys import GlobalKeys
from mlxq.shared.protocol import Queue
from mlxq.shared.settings import Settings
from mlxq.shared.steps import run_steps
from workerkit import model_without_worker

GK = GlobalKeys()
MODEL = "quota"


def test_a_key_over_its_daily_tokens_is_refused_until_the_next_day(redis_url, tmp_path, capsys, monkeypatch):
    with model_without_worker(redis_url, MODEL) as r:  # (its jobs wait: no worker runs them)
        over_quota(redis_url, r, tmp_path, capsys, monkeypatch)


def over_quota(redis_url, r, tmp_path, capsys, monkeypatch):
    from mlxq.producer.gateway import ServerThread, create_app

    apikeys.add_key(r, GK, "metered-key-aaaa", "normal", name="metered")
    apikeys.add_key(r, GK, "other-key-bbbbbb", "normal", name="other")
    apikeys.set_limits(r, GK, "metered", daily_tokens=50)
    with Client(redis_url, model=MODEL, api_key="metered-key-aaaa") as c:
        job = c.submit("a prompt", max_tokens=3, subscribe=False)  # under its quota: queued
        q = Queue(r, GK.model_keys(MODEL), Settings())
        [pulled] = q.pull(1, "w")
        assert q.complete(job.id, "w:1", "done", b"r", usage=(40, 12)) == 1  # 52 tokens today
        with pytest.raises(QuotaExceeded) as refused:
            c.submit("one more", max_tokens=3, subscribe=False)
        assert 0 < refused.value.retry_after_s <= 86400
    with Client(redis_url, model=MODEL, api_key="other-key-bbbbbb") as c:
        assert c.submit("another key's job", max_tokens=3, subscribe=False)  # its own day, untouched

    async def async_submit():
        async with AsyncClient(redis_url, model=MODEL, api_key="metered-key-aaaa") as ac:
            await ac.submit("from asyncio", max_tokens=3, subscribe=False)

    with pytest.raises(QuotaExceeded):
        asyncio.run(async_submit())
    [row] = [u for u in apikeys.usage(r, GK) if u["key"] == "metered"]
    assert (row["model"], row["prompt_tokens"], row["completion_tokens"], row["jobs"]) == (MODEL, 40, 12, 1)

    with ServerThread(create_app(redis_url, Settings(no_worker_wait_s=0.1))) as base:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30,
                           headers={"Authorization": "Bearer metered-key-aaaa"})
        assert reply.status_code == 429
        assert 0 < int(reply.headers["Retry-After"]) <= 86400
        error = reply.json()["error"]
        assert error["code"] == "insufficient_quota" and "quota" in error["message"]
    bulk_over_quota(redis_url, tmp_path, capsys, monkeypatch)
    apikeys.set_limits(r, GK, "metered", daily_tokens=0)  # lifted: served again
    with Client(redis_url, model=MODEL, api_key="metered-key-aaaa") as c:
        assert c.submit("after the quota", max_tokens=3, subscribe=False)


def bulk_over_quota(redis_url, tmp_path, capsys, monkeypatch):
    """``Client.map`` and ``mlxq batch`` end with the QuotaExceeded, which says when the quota resets,
    rather than waiting for it (only a reset under ``QUOTA_WAIT_MAX_S`` away is waited for: 0 here, so
    that the UTC day turning during the test changes nothing)."""
    from mlxq.cli import main

    monkeypatch.setattr(bulkmap, "QUOTA_WAIT_MAX_S", 0.0)
    with Client(redis_url, model=MODEL, api_key="metered-key-aaaa") as c:
        with pytest.raises(QuotaExceeded, match="daily token quota is used up: retry in"):
            next(iter(c.map(["a", "b"], max_tokens=3)))
    src = tmp_path / "in.jsonl"
    src.write_text('"a prompt"\n')
    monkeypatch.setenv("MLXQ_API_KEY", "metered-key-aaaa")
    assert main(["batch", str(src), "-o", str(tmp_path / "out.jsonl"), "--redis-url", redis_url, "--queue", MODEL,
                 "-q"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mlxq batch: QuotaExceeded: ") and "next UTC day" in err[-1]


def test_a_bulk_submit_waits_for_a_quota_that_resets_soon(monkeypatch):
    """A reset under ``QUOTA_WAIT_MAX_S`` away: the submit sleeps until it and tries again."""
    tries = []

    def bulk_submit(*args):
        tries.append(args)
        if len(tries) == 1:
            raise QuotaExceeded(bulkmap.QUOTA_WAIT_MAX_S / 2)
        return "submitted"
        yield  # (a generator, as bulk_submit is)

    monkeypatch.setattr(bulkmap, "bulk_submit", bulk_submit)
    slept = []
    assert run_steps(bulkmap.bulk_submit_patiently({}, "low", 1000, None), lambda op: slept.append(op)) == "submitted"
    assert len(tries) == 2 and [op.seconds for op in slept] == [bulkmap.QUOTA_WAIT_MAX_S / 2]
