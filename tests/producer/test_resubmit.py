"""A job is never lost to a failover, from the caller's view: a producer that finds its
job's record gone (a write lost with a master that died before its replica had it) submits the job
again under the same idempotency key, carrying the token ids it has already seen (``resume_ids``);
the worker takes them as published output, so the stream goes on with no token twice, and the
result holds the whole output.

The loss is made by deleting the job's keys while the worker is frozen (SIGSTOP) mid-stream: what a
failover within the replication window leaves.  Expected tokens are computed in the same run."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from mlxq import AsyncClient, Client
from mlxq.shared.keys import ModelKeys
from workerkit import fast_settings, running_worker, wait_for
from faultkit import WorkerProc, detok_text, reference_tokens, wait_registered

K = ModelKeys("tiny")
N_TOK, SEEN = 160, 12
RESUBMITTED = "submitted again as job"


def test_resume_ids_are_taken_as_published_output(tiny_model, redis_url):
    """A request carrying the first k tokens of its answer: the stream starts at index k, its text
    goes on after theirs, and the result holds the whole answer, as the uninterrupted job's."""
    prompt, k = [5, 17, 33, 8], 9
    ref = reference_tokens(tiny_model, prompt, 40, ignore_eos=True)
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    with running_worker(tiny_model, redis_url, settings):
        job = client.submit(prompt_tokens=prompt, max_tokens=40, ignore_eos=True, resume_ids=ref[:k])
        deltas = list(job.stream(timeout=60))
        res = job.result(timeout=60)
        whole = client.submit(prompt_tokens=prompt, max_tokens=40, ignore_eos=True).result(timeout=60)
    streamed_ids = [t for d in deltas for t in d.token_ids]
    streamed_text = "".join(d.text for d in deltas)
    assert deltas[0].index == k and streamed_ids == ref[k:]  # no token twice
    assert res.token_ids == ref == whole.token_ids and res.text == whole.text == detok_text(tiny_model.tokenizer, ref)
    assert deltas[0].offset + len(streamed_text) == len(res.text) and res.text.endswith(streamed_text)
    client.close()


def test_resume_ids_are_checked(tiny_model, redis_url):
    client = Client(redis_url, model="tiny", settings=fast_settings(redis_url))
    for bad, why in (([1, -2], "non-negative"), ([1] * 5, "more than max_tokens")):
        with pytest.raises(ValueError, match=why):
            client.submit(prompt_tokens=[5, 6], max_tokens=4, resume_ids=bad)
    with pytest.raises(ValueError, match="n > 1"):
        client.submit(prompt_tokens=[5, 6], max_tokens=4, n=2, resume_ids=[1])
    client.close()


def _lose(r, job_id: str) -> None:
    """What a failover inside the replication window leaves of a job: no record at all."""
    r.delete(K.job(job_id), K.events(job_id), K.done(job_id))


def test_a_record_lost_under_a_waiting_client_async_client_and_gateway_stream(tiny_model, tiny_model_dir,
                                                                               redis_url, tmp_path, caplog):
    """Each kind of producer streams a long job; with the worker frozen once the caller has seen
    SEEN tokens, the job's record is deleted; the worker goes on (its writes for the old job are
    fenced off).  Each producer submits the job again once, and its stream and result are exact."""
    import openai

    from mlxq.producer.gateway import ServerThread, create_app

    caplog.set_level(logging.WARNING, logger="mlxq.producer")
    prompts = {"client": [7, 21, 40, 3], "async": [8, 22, 41, 4], "gateway": [9, 23, 42, 5]}
    refs = {kind: reference_tokens(tiny_model, p, N_TOK, ignore_eos=True) for kind, p in prompts.items()}
    settings = fast_settings(redis_url)
    worker = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=4)
    client = Client(redis_url, model="tiny", settings=settings)
    r = client.redis
    try:
        assert wait_registered(redis_url), worker.log()
        seen: dict[str, list] = {kind: [] for kind in prompts}  # (ids, text) per delta as the caller got it
        out: dict = {}

        def sync_run():
            job = client.submit(prompt_tokens=prompts["client"], max_tokens=N_TOK, ignore_eos=True)
            out["client_first"] = job.id
            for d in job.stream(timeout=120):
                seen["client"].append((d.token_ids, d.text))
            out["client"] = (job.id, job.result(timeout=120))

        async def async_main():
            ac = AsyncClient(redis_url, model="tiny", settings=settings)
            job = await ac.submit(prompt_tokens=prompts["async"], max_tokens=N_TOK, ignore_eos=True)
            out["async_first"] = job.id
            async for d in job.stream(timeout=120):
                seen["async"].append((d.token_ids, d.text))
            out["async"] = (job.id, await job.result(timeout=120))
            await ac.aclose()

        def gateway_run(url):
            oai = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
            for c in oai.completions.create(model="tiny", prompt=prompts["gateway"], max_tokens=N_TOK, stream=True,
                                            extra_body={"ignore_eos": True}):
                if c.choices:
                    seen["gateway"].append(([], c.choices[0].text))
                    out.setdefault("gateway_first", c.id.removeprefix("cmpl-"))
            out["gateway"] = True

        with ServerThread(create_app(redis_url, settings)) as gw:
            runs = {"client": sync_run, "async": lambda: asyncio.run(async_main()), "gateway": lambda: gateway_run(gw)}
            for kind, run in runs.items():
                n_before = len([x for x in caplog.messages if RESUBMITTED in x])
                t = threading.Thread(target=run, daemon=True)
                t.start()
                # frozen once the caller has seen SEEN tokens' text: the job is surely mid-stream
                assert worker.run_until(lambda: sum(len(x) for _, x in seen[kind]) >= SEEN), worker.log()
                first = out[f"{kind}_first"]
                _lose(r, first)
                worker.thaw()
                t.join(timeout=120)
                assert not t.is_alive() and kind in out, kind
                text = "".join(x for _, x in seen[kind])
                assert text == detok_text(tiny_model.tokenizer, refs[kind]), kind  # the stream, exact
                assert len([x for x in caplog.messages if RESUBMITTED in x]) == n_before + 1, kind  # once
                if kind != "gateway":
                    new_id, res = out[kind]
                    assert new_id != first  # the handle follows the new job
                    assert [t for ids, _ in seen[kind] for t in ids] == refs[kind] == res.token_ids, kind
                    assert res.text == text, kind  # the result holds the whole output
    finally:
        worker.stop()
        client.close()


# -- submit_replica_ack_ms: WAIT 1 <ms> after the submit, on its connection -----------------------------
def test_submit_waits_for_a_replica_when_asked(tmp_path, caplog):
    """On a cluster with replicas, a Client's and an AsyncClient's submit return once the slot's
    replica has the job (read there, READONLY, at once); on a Redis with no replica the wait runs out
    and says so in one warning, the job queued all the same."""
    import redis

    from clusterkit import EmbeddedCluster
    from mlxq.shared.embedded import EmbeddedRedis

    caplog.set_level(logging.WARNING)
    with EmbeddedCluster(masters=3, replicas=1) as cluster:
        url = cluster.masters[0].url
        master = cluster.master_for(K.queue)
        replica = cluster.replicas[cluster.masters.index(master)][0]
        settings = fast_settings(url, submit_replica_ack_ms=5000)
        on_replica = redis.Redis(port=replica.port, single_connection_client=True)
        on_replica.execute_command("READONLY")
        client = Client(url, model="tiny", settings=settings)
        ids = [client.submit(prompt_tokens=[5, 6], max_tokens=2).id for _ in range(3)]

        async def async_submits():
            ac = AsyncClient(url, model="tiny", settings=settings)
            out = [(await ac.submit(prompt_tokens=[5, 6], max_tokens=2)).id for _ in range(3)]
            await ac.aclose()
            return out

        ids += asyncio.run(async_submits())
        assert all(on_replica.exists(K.job(i)) for i in ids)
        assert not [m for m in caplog.messages if "no replica acknowledged" in m]
        on_replica.close()
        client.close()
    srv = EmbeddedRedis(tmp_path / "single").start()
    try:
        client = Client(srv.url, model="tiny", settings=fast_settings(srv.url, submit_replica_ack_ms=50))
        job = client.submit(prompt_tokens=[5, 6], max_tokens=2)
        assert job.status().startswith("queued")
        assert [m for m in caplog.messages if "no replica acknowledged" in m and job.id in m]
        client.close()
    finally:
        srv.stop()


def test_records_lost_under_map_and_batch_are_submitted_again(tiny_model, redis_url, tmp_path, caplog):
    """``Client.map`` and ``mlxq batch`` wait by polling records, with no stream: every record lost
    while its job is queued (no worker yet) is submitted again, once, and every line's answer is the
    one a fresh submit gets."""
    import json

    from mlxq.producer.bulk import BatchRun

    caplog.set_level(logging.WARNING, logger="mlxq.producer")
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    r = client.redis
    with running_worker(tiny_model, redis_url, settings):  # registers the model, then leaves
        assert wait_for(lambda: "tiny" in client.models(), timeout=10)
    prompts = ["one two", "three four", "five six"]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": p, "prompt": p, "max_tokens": 6, "ignore_eos": True}) + "\n"
                           for p in prompts))
    out: dict = {}
    runs = [threading.Thread(target=lambda: out.setdefault("map", list(client.map(prompts, max_tokens=6,
                                                                                    ignore_eos=True))), daemon=True),
            threading.Thread(target=lambda: out.setdefault("batch", BatchRun(client, str(src), str(dst),
                                                                             progress=False).run()), daemon=True)]
    for t in runs:
        t.start()
    assert wait_for(lambda: r.zcard(K.queue) == 2 * len(prompts), timeout=30)
    for job_id in r.zrange(K.queue, 0, -1):
        _lose(r, job_id.decode())
    with running_worker(tiny_model, redis_url, settings):
        for t in runs:
            t.join(timeout=120)
            assert not t.is_alive()
        want = [client.submit(p, max_tokens=6, ignore_eos=True).result(timeout=60).text for p in prompts]
    assert [res.text for res in out["map"]] == want and all(res.finish_reason == "length" for res in out["map"])
    lines = {rec["custom_id"]: rec for rec in map(json.loads, dst.read_text().splitlines())}
    assert out["batch"].written == len(prompts)
    assert [lines[p]["response"]["body"]["choices"][0]["text"] for p in prompts] == want
    assert len([x for x in caplog.messages if "submitted again as job" in x]) == 2 * len(prompts)  # once each
    client.close()
