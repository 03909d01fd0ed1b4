"""Prometheus metrics of a worker (an observer) scraped over HTTP and parsed with prometheus_client."""

from __future__ import annotations

import urllib.request

import redis
from prometheus_client.parser import text_string_to_metric_families

from mlxq import Client
from mlxq.shared.keys import GlobalKeys
from workerkit import fast_settings, running_worker, wait_for
from mlxq.worker.metrics import WorkerMetrics


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    for s in families[name].samples:
        if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((name, sample, labels))


def test_worker_metrics_scrape(tiny_model, redis_url):
    r = redis.Redis.from_url(redis_url)
    metrics = WorkerMetrics(r, GlobalKeys().model_keys("tiny"), "tiny")
    port = metrics.serve(0, addr="127.0.0.1")
    from mlxq.worker.engine import PagedEngine

    engine = PagedEngine(tiny_model.model, memory_budget_bytes=4 << 20, max_batch=4,
                         eos_token_ids=tiny_model.eos_token_ids, model_id="tiny", speculate="ngram")
    # speculative decoding at every step, each row proposing its last token twice (whatever the tiny
    # model writes; the verify pass keeps the output what it would be)
    engine.speculator.costs.always = True
    engine.speculator.propose = lambda seq, k: [seq.tokens[-1]] * min(k, 2)
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    try:
        queued = client.submit("waiting in line", max_tokens=2, ignore_eos=True)  # before the worker: queue depth 1
        before = scrape(port)
        assert value(before, "mlxq_queue_depth", model="tiny", tier="normal") == 1
        with running_worker(tiny_model, redis_url, settings, engine=engine, observers=[metrics]) as w:
            jobs = [client.submit(f"prompt {i}", max_tokens=8, ignore_eos=True) for i in range(3)]
            results = [j.result(timeout=60) for j in jobs + [queued]]
            generated = sum(res.stats.generated_tokens for res in results)
            proposed = sum(res.stats.draft_proposed for res in results)
            w.stats.snap_at = 0.0  # the next loop pass publishes a fresh snapshot
            seen: dict = {}

            def settled():  # the observer has counted every finished job (an event, not a delay)
                seen["after"] = fam = scrape(port)
                finished = sum(s.value for s in fam["mlxq_jobs_finished"].samples if s.name.endswith("_total"))
                return (finished == 4 and value(fam, "mlxq_queue_depth", model="tiny", tier="normal") == 0
                        and "mlxq_draft_proposed_tokens" in fam  # a snapshot after the last verify pass
                        and value(fam, "mlxq_draft_proposed_tokens", "mlxq_draft_proposed_tokens_total",
                                  model="tiny") == proposed)

            assert wait_for(settled, timeout=60)
            after = seen["after"]
    finally:
        metrics.shutdown()
        r.close()
    assert value(after, "mlxq_generated_tokens", "mlxq_generated_tokens_total", model="tiny") == generated
    assert value(after, "mlxq_ttft_seconds", "mlxq_ttft_seconds_count", model="tiny") == 4
    # each job's tokens after its first give one inter-token sample
    assert value(after, "mlxq_inter_token_latency_seconds", "mlxq_inter_token_latency_seconds_count",
                 model="tiny") == generated - 4
    assert value(after, "mlxq_jobs_finished", "mlxq_jobs_finished_total", model="tiny", reason="length") >= 3
    assert sum(s.value for s in after["mlxq_jobs_finished"].samples if s.name.endswith("_total")) == 4
    assert value(after, "mlxq_job_errors", "mlxq_job_errors_total", model="tiny") == 0
    assert value(after, "mlxq_queue_depth", model="tiny", tier="normal") == 0
    # each job's tokens, counted for its key (here none) by the worker's completion, by the key's name
    assert value(after, "mlxq_key_tokens_today", model="tiny", key="(no key)", kind="completion") == generated
    assert value(after, "mlxq_key_tokens_today", model="tiny", key="(no key)", kind="prompt") == sum(
        res.stats.prompt_tokens for res in results)
    assert {"mlxq_active_jobs", "mlxq_tokens_per_second", "mlxq_prefix_hit_rate"} <= set(after)
    assert 0.0 <= value(after, "mlxq_prefix_hit_rate", model="tiny") <= 1.0
    used, free = value(after, "mlxq_kv_blocks_used", model="tiny"), value(after, "mlxq_kv_blocks_free", model="tiny")
    assert free > 0 and used >= 0
    assert value(after, "mlxq_preemptions", "mlxq_preemptions_total", model="tiny") >= 0
    # speculative decoding: each job's counts in its stats, the engine's totals in the metrics
    st = engine.stats()
    assert proposed == st["draft_proposed"] > 0
    assert sum(res.stats.draft_accepted for res in results) == st["draft_accepted"]
    assert value(after, "mlxq_draft_acceptance_rate", model="tiny") == st["draft_accepted"] / st["draft_proposed"]


def test_inter_token_latency_is_per_sample_and_ttft_once_per_job():
    """n > 1: the samples' tokens interleave; ITL is the gap between one sample's own tokens, and
    TTFT is observed once for the job (no timing: the hook gets explicit clock values)."""
    from types import SimpleNamespace

    import fakeredis

    metrics = WorkerMetrics(fakeredis.FakeRedis(), GlobalKeys().model_keys("m"), "m")
    from mlxq.worker.jobs import sample_uid

    samples = [SimpleNamespace(id="j", sample=i, uid=sample_uid("j", i), group=SimpleNamespace(n=2),
                               first_token_at=1.0, queued_at=0.5, tier="normal") for i in range(2)]
    for step in range(5):  # each sample every 10 ms, the two 5 ms apart
        for i, s in enumerate(samples):
            metrics.on_token(s, 1, 1.0 + step * 0.010 + i * 0.005)

    def sample_value(name):
        for fam in metrics.registry.collect():
            for s in fam.samples:
                if s.name == name:
                    return s.value
        raise KeyError(name)

    itl_n = sample_value("mlxq_inter_token_latency_seconds_count")
    assert itl_n == 8
    assert abs(sample_value("mlxq_inter_token_latency_seconds_sum") / itl_n - 0.010) < 1e-9
    assert sample_value("mlxq_ttft_seconds_count") == 1
    metrics.on_finish(samples[1], SimpleNamespace(finish_reason="stop", stats=SimpleNamespace(
        prompt_tokens=3, cached_tokens=0, queue_wait_s=0.25, queued_at=0.5, finished_at=1.5)))
    assert not metrics._last_token  # every sample's clock dropped with the job
