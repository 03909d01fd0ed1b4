"""An OpenAI batch survives its worker's kill -9 and its gateway's restart, tried as a pipeline runs
one: the official ``openai`` client uploads the requests, creates the batch and polls it; the worker
process gets kill -9 with some lines answered and others running; the gateway is stopped and a new
one started (its driver takes the batch up from Redis and submits the unanswered lines again under
their idempotency keys); a new worker finishes the batch.  Every ``custom_id`` is answered exactly
once, by one job each, and equals the same request made directly (greedy, in this run)."""

from __future__ import annotations

import json

import openai

from faultkit import WorkerProc, record, wait_registered
from mlxq.producer.gateway import ServerThread, create_app
from mlxq.producer.records import result_from_hash
from mlxq.shared.keys import GlobalKeys, ModelKeys
from workerkit import fast_settings, wait_for

N_LINES, MAX_TOKENS = 8, 24
K = ModelKeys("tiny")


def _line(i: int) -> dict:
    return {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Summarise document {i}."}],
                     "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}


def _oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=60)


def _direct(client: openai.OpenAI, body: dict) -> str:
    body = dict(body)
    extra = {"ignore_eos": body.pop("ignore_eos")}
    return client.chat.completions.create(**body, extra_body=extra).choices[0].message.content


def test_worker_killed_and_gateway_restarted_mid_batch(redis_url, tiny_model_dir, tmp_path):
    import redis

    r = redis.Redis.from_url(redis_url)
    settings = fast_settings(redis_url)
    # judged dead 1.5 s after its last beat (a live one judged dead by mistake has its jobs fenced and
    # taken over: each still one job, answered once)
    worker = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=4, takeover_s=1.5)
    gateway = ServerThread(create_app(redis_url, settings))
    try:
        assert wait_registered(redis_url, timeout=120), worker.log()
        client = _oai(gateway.__enter__())
        f = client.files.create(file=("docs.jsonl", "".join(json.dumps(_line(i)) + "\n" for i in range(N_LINES))),
                                purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        bk = GlobalKeys().batch(batch.id)

        def states() -> list[bool]:  # per queued line: has its job ended?
            jobs = [v.decode().split(" ")[1] for v in r.hvals(bk.jobs)]
            return [result_from_hash(j, r.hgetall(K.job(j))) is not None for j in jobs]

        # frozen with some lines answered and some not: the kill lands mid-batch
        assert worker.run_until(lambda: len(states()) == N_LINES and 0 < sum(states()) < N_LINES), worker.log()
        worker.kill9()
        gateway.__exit__(None, None, None)  # its driver lets the batch go (the lease released)
        gateway = ServerThread(create_app(redis_url, settings))
        client = _oai(gateway.__enter__())
        worker = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=4)
        assert wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", timeout=180,
                        interval=0.1), worker.log()
        done = client.batches.retrieve(batch.id)
        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        direct = {f"doc-{i}": _direct(client, _line(i)["body"]) for i in range(N_LINES)}
    finally:
        gateway.__exit__(None, None, None)
        worker.stop()
        r.close()
    assert done.error_file_id is None and done.request_counts.completed == N_LINES
    assert [o["custom_id"] for o in out] == [f"doc-{i}" for i in range(N_LINES)]  # each exactly once
    assert len({o["response"]["request_id"] for o in out}) == N_LINES  # one job per line: none ran twice
    for o in out:
        assert o["response"]["body"]["choices"][0]["message"]["content"] == direct[o["custom_id"]]
    record("openai batch: worker kill -9 and gateway restart mid-batch", N_LINES, len(out), 0, 0)
