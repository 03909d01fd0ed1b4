"""Prometheus metrics of one worker: a Worker observer with its own CollectorRegistry.

    metrics = WorkerMetrics(redis, keys, model="tiny")
    Worker(..., observers=[metrics]); metrics.serve(9100)     # GET http://host:9100/metrics

Token and job events come from the observer hooks (cheap: counters and histograms, no MLX,
no I/O).  Queue depth per tier is read from Redis at scrape time, on the HTTP thread; engine
figures (KV blocks, prefix hits, preemptions) come from the worker's latest snapshot.
"""

from __future__ import annotations

import logging
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..shared.settings import TIERS
from .jobs import sample_uid

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class WorkerMetrics:
    """Observer: ``on_token``, ``on_finish``, ``on_snapshot``; ``serve(port)`` exposes /metrics."""

    def __init__(self, redis_client, keys, model: str, registry: Optional[CollectorRegistry] = None):
        self.registry = registry or CollectorRegistry()
        self.model = model
        labels = ["model"]
        self.ttft = Histogram("mlxq_ttft_seconds", "Time from enqueue to a job's first token",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("mlxq_inter_token_latency_seconds", "Time between a job's consecutive tokens",
                             labels, buckets=ITL_BUCKETS, registry=self.registry)
        self.tokens = Counter("mlxq_generated_tokens", "Tokens generated", labels, registry=self.registry)
        self.finished = Counter("mlxq_jobs_finished", "Jobs finished on this worker, by finish reason",
                                labels + ["reason"], registry=self.registry)
        self.errors = Counter("mlxq_job_errors", "Jobs that finished with an error", labels,
                              registry=self.registry)
        self.prompt_tokens = Counter("mlxq_prompt_tokens", "Prompt tokens of finished jobs", labels,
                                     registry=self.registry)
        self.cached_tokens = Counter("mlxq_prefix_cached_tokens", "Prompt tokens served from the prefix cache",
                                     labels, registry=self.registry)
        self.tokens.labels(model)  # present from the first scrape
        self.errors.labels(model)
        self._last_token: dict[str, float] = {}
        self._prompt_total = 0  # for the hit rate when the engine reports no prefix figures
        self._cached_total = 0
        self._snapshot: dict = {}
        self.registry.register(_ScrapeCollector(self, redis_client, keys))
        self._server = None

    # -- observer hooks (MLX thread: keep them cheap) ----------------------------------
    def on_token(self, job, n: int, now: float) -> None:
        # per engine sequence: the samples of a job with n > 1 interleave, and the gap that matters
        # is between one sample's own tokens
        key = job.uid
        last = self._last_token.get(key)
        if last is None:
            if not job.sample and job.first_token_at is not None and job.queued_at:
                self.ttft.labels(self.model).observe(max(0.0, job.first_token_at - job.queued_at))  # once a job
        elif n > 0:
            self.itl.labels(self.model).observe(max(0.0, (now - last) / n))
        self._last_token[key] = now
        self.tokens.labels(self.model).inc(n)

    def on_finish(self, job, result) -> None:
        for i in range(job.group.n) if job.group is not None else (None,):
            self._last_token.pop(sample_uid(job.id, i), None)
        self.finished.labels(self.model, result.finish_reason).inc()
        if result.finish_reason == "error":
            self.errors.labels(self.model).inc()
        self.prompt_tokens.labels(self.model).inc(result.stats.prompt_tokens)
        self.cached_tokens.labels(self.model).inc(result.stats.cached_tokens)
        self._prompt_total += result.stats.prompt_tokens
        self._cached_total += result.stats.cached_tokens

    def on_snapshot(self, snapshot: dict) -> None:
        self._snapshot = snapshot  # replaced whole, read by the scrape thread

    # -- serving ---------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on a daemon thread; returns the port (pass 0 for a free one).  Loopback unless
        ``addr`` says otherwise (`mlxq worker --metrics-host 0.0.0.0`)."""
        self._server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        port = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", addr, port)
        return port

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None


class _ScrapeCollector:
    """Values read at scrape time: queue depth (Redis) and the worker snapshot."""

    def __init__(self, metrics: WorkerMetrics, redis_client, keys):
        self.m = metrics
        self.redis = redis_client
        self.keys = keys

    def describe(self):
        return []  # no describe: the collector is not run at registration

    def collect(self):
        model = self.m.model
        depth = GaugeMetricFamily("mlxq_queue_depth", "Jobs waiting in the queue, per tier", labels=["model", "tier"])
        try:
            counts = {k.decode(): int(v) for k, v in self.redis.hgetall(self.keys.counts).items()}
            for tier in TIERS:
                depth.add_metric([model, tier], counts.get(f"queued:{tier}", 0))
        except Exception as exc:  # a scrape must not fail because Redis blinked
            log.warning("metrics: queue depth unavailable: %s", exc)
        yield depth

        snap = self.m._snapshot
        yield _gauge("mlxq_active_jobs", "Jobs in this worker's batch", model, snap.get("active", 0))
        yield _gauge("mlxq_tokens_per_second", "Generation throughput over the last second", model,
                     snap.get("tok_s_current", 0.0))
        if "engine_blocks_used" in snap:
            yield _gauge("mlxq_kv_blocks_used", "KV cache blocks in use", model, snap["engine_blocks_used"])
        if "engine_blocks_free" in snap:
            yield _gauge("mlxq_kv_blocks_free", "KV cache blocks free", model, snap["engine_blocks_free"])
        if "engine_preemptions" in snap:
            c = CounterMetricFamily("mlxq_preemptions", "Sequences preempted for KV memory", labels=["model"])
            c.add_metric([model], snap["engine_preemptions"])
            yield c
        hits, prompt = snap.get("engine_prefix_hit_tokens"), snap.get("engine_prompt_tokens")
        if hits is None or not prompt:  # no engine figures: use finished jobs' stats
            hits, prompt = self.m._cached_total, self.m._prompt_total
        yield _gauge("mlxq_prefix_hit_rate", "Share of prompt tokens served from the prefix cache", model,
                     hits / prompt if prompt else 0.0)


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["model"])
    g.add_metric([model], float(value))
    return g
