"""The engine through Redis: an urgent job is pulled at once and preempts; the preempted job resumes exactly."""

from __future__ import annotations

import threading

from workerkit import fast_settings, running_worker, tier_clients, wait_for
from faultkit import reference_tokens


def test_urgent_job_is_pulled_while_full_and_preempts(tiny_model, redis_url):
    from mlxq.worker.engine import PagedEngine

    settings = fast_settings(redis_url)
    admin, low, high = tier_clients(redis_url, settings, "0002")
    prompts = [[10 + i, 20, 30, 40, 50] for i in range(2)]
    n_low = 600  # long by construction: still running when the urgent job arrives and ends
    refs = [reference_tokens(tiny_model, p, n_low, ignore_eos=True) for p in prompts]
    hi_ref = reference_tokens(tiny_model, [7, 8, 9], 5, ignore_eos=True)
    engine = PagedEngine(tiny_model.model, num_blocks=64, max_batch=2, eos_token_ids=tiny_model.eos_token_ids,
                         model_id="tiny")
    first_tokens = [threading.Event() for _ in prompts]
    streamed: dict = {i: [] for i in range(len(prompts))}

    def follow(i, job):
        for d in job.stream(timeout=120):
            streamed[i] += d.token_ids
            if streamed[i]:
                first_tokens[i].set()

    with running_worker(tiny_model, redis_url, settings, engine=engine) as w:
        lows = [low.submit(prompt_tokens=p, max_tokens=n_low, ignore_eos=True) for p in prompts]
        threads = [threading.Thread(target=follow, args=(i, j)) for i, j in enumerate(lows)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in first_tokens)  # both stream: the engine is full (max_batch 2)
        hi = high.submit(prompt_tokens=[7, 8, 9], max_tokens=5, ignore_eos=True)
        hi_res = hi.result(timeout=60)
        assert hi_res.token_ids == hi_ref
        # the urgent job finished while the long low jobs still run: it preempted one of them
        assert not any(j.status() == "done" for j in lows)
        assert w.engine.stats()["preemptions"] >= 1
        results = [j.result(timeout=120) for j in lows]
        for t in threads:
            t.join(timeout=60)
        assert wait_for(lambda: not w.engine.has_work() and not w.active, timeout=10)
        assert w.engine.stats()["blocks_used"] == 0
    for i, (res, ref) in enumerate(zip(results, refs)):
        assert res.token_ids == ref, i  # the preempted job resumed exactly
        assert streamed[i] == ref, i  # and streamed nothing twice
