"""A Client shared by threads, and an AsyncClient shared by tasks, work from their first call:
every lazily made resource (reader threads, pub/sub links, queues, the model
choice) is made once, however many callers arrive at the same moment."""

from __future__ import annotations

import asyncio
import threading

from mlxq import AsyncClient, Client
from workerkit import fast_settings, running_worker
from faultkit import reference_tokens, wait_registered

THREADS, ROUNDS, TASKS, MAX_TOKENS = 16, 20, 64, 3


def _prompts(n):
    return [[5 + i % 50, 9 + (7 * i) % 40, 11] for i in range(n)]


def _references(loaded, prompts):
    return {tuple(p): reference_tokens(loaded, p, MAX_TOKENS, ignore_eos=True) for p in set(map(tuple, prompts))}


def test_a_fresh_client_shared_by_16_threads_released_at_once(tiny_model, redis_url):
    settings = fast_settings(redis_url)
    prompts = _prompts(THREADS)
    refs = _references(tiny_model, prompts)
    failures, wrong = [], []
    with running_worker(tiny_model, redis_url, settings, max_batch=THREADS):
        assert wait_registered(redis_url)
        for _ in range(ROUNDS):
            client = Client(redis_url, settings=settings)  # fresh: no reader, no queue, no model chosen
            gate = threading.Barrier(THREADS)

            def one(prompt):
                try:
                    gate.wait(timeout=60)
                    job = client.submit(prompt_tokens=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
                    streamed = [t for d in job.stream(timeout=60) for t in d.token_ids]
                    res = job.result(timeout=60)
                    if res.token_ids != refs[tuple(prompt)] or streamed != res.token_ids:
                        wrong.append((prompt, streamed, res.token_ids))
                except Exception as exc:  # reported below
                    failures.append(repr(exc))

            threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert not any(t.is_alive() for t in threads)
            assert client.subscriber.connections() <= 1  # one pub/sub link, however many threads
            client.close()
    assert failures == [] and wrong == []


def test_a_fresh_async_client_shared_by_64_tasks_gathered_at_once(tiny_model, redis_url):
    settings = fast_settings(redis_url)
    prompts = _prompts(TASKS)
    refs = _references(tiny_model, prompts)

    async def one(client, prompt):
        job = await client.submit(prompt_tokens=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        streamed = [t for d in [d async for d in job.stream(timeout=60)] for t in d.token_ids]
        return streamed, (await job.result(timeout=60)).token_ids

    async def run():
        out = []
        for _ in range(3):
            client = AsyncClient(redis_url, settings=settings)
            out.append(await asyncio.gather(*(one(client, p) for p in prompts), return_exceptions=True))
            links = client.subscriber.connections()
            # held now: the pub/sub link only (a second task racing to open it would leak one)
            in_use = len(client.redis.connection_pool._in_use_connections)
            await client.aclose()
            assert in_use == 1
            assert links <= 1
        return out

    with running_worker(tiny_model, redis_url, settings, max_batch=TASKS):
        assert wait_registered(redis_url)
        rounds = asyncio.run(run())
    for results in rounds:
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors == []
        assert all(streamed == tokens == refs[tuple(p)] for p, (streamed, tokens) in zip(prompts, results))
