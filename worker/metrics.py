"""Prometheus metrics of one worker: a Worker observer with its own CollectorRegistry, served with
the worker's health endpoint (worker/health.py).

    metrics = WorkerMetrics(redis, keys, model="tiny")
    worker = Worker(..., observers=[metrics])
    metrics.serve(9100, health=WorkerHealth.of(worker))   # GET /metrics, /health, /ready

Token and job events come from the observer hooks (cheap: counters and histograms, no MLX,
no I/O).  Queue depth per tier is read from Redis at scrape time, on the HTTP thread, by one
worker of the model at a time (see ``_ScrapeCollector``); engine figures (KV blocks, prefix hits,
preemptions) come from the worker's latest snapshot.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from http import HTTPStatus
from socketserver import ThreadingMixIn
from typing import Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..shared import apikeys
from ..shared.keys import GlobalKeys
from ..shared.settings import TIERS
from .jobs import sample_uid

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)  # low tier waits long
# The queue-depth exporter's lease: longer than Prometheus's usual scrape intervals (15 s, 30 s), so
# that the exporter keeps it from one scrape to the next; a worker that stops (or is no longer
# scraped) hands it on within this.
EXPORTER_LEASE_S = 60.0
# take the lease when free, or renew it when it is ours: 1 when this process exports
_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class WorkerMetrics:
    """Observer: ``on_token``, ``on_finish``, ``on_snapshot``; ``serve(port)`` exposes /metrics."""

    def __init__(self, redis_client, keys, model: str, registry: Optional[CollectorRegistry] = None):
        self.registry = registry or CollectorRegistry()
        self.model = model
        labels = ["model"]
        # latency by tier: the tiers are queued apart on purpose (a low-tier job waits behind the
        # others), so one histogram of all would hide whether each meets its own target
        by_tier = ["model", "tier"]
        self.ttft = Histogram("mlxq_ttft_seconds", "Time from enqueue to a job's first token",
                              by_tier, buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("mlxq_inter_token_latency_seconds", "Time between a job's consecutive tokens",
                             by_tier, buckets=ITL_BUCKETS, registry=self.registry)
        self.queue_wait = Histogram("mlxq_queue_wait_seconds", "Time from enqueue to a job's start on a worker "
                                    "(its first start, for a job that ran again)", by_tier,
                                    buckets=WAIT_BUCKETS, registry=self.registry)
        self.end_to_end = Histogram("mlxq_end_to_end_seconds", "Time from enqueue to a job's end, by how it "
                                    "ended", by_tier + ["reason"], buckets=WAIT_BUCKETS, registry=self.registry)
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
        self._collector = _ScrapeCollector(self, redis_client, keys)
        self.registry.register(self._collector)
        self._server = None

    # -- observer hooks (MLX thread: keep them cheap) ----------------------------------
    def on_token(self, job, n: int, now: float) -> None:
        # per engine sequence: the samples of a job with n > 1 interleave, and the gap that matters
        # is between one sample's own tokens
        key = job.uid
        last = self._last_token.get(key)
        if last is None:
            if not job.sample and job.first_token_at is not None and job.queued_at:
                self.ttft.labels(self.model, job.tier).observe(max(0.0, job.first_token_at - job.queued_at))
        elif n > 0:
            self.itl.labels(self.model, job.tier).observe(max(0.0, (now - last) / n))
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
        st = result.stats
        if st.queue_wait_s is not None:
            self.queue_wait.labels(self.model, job.tier).observe(st.queue_wait_s)
        if st.queued_at and st.finished_at:
            self.end_to_end.labels(self.model, job.tier, result.finish_reason).observe(
                max(0.0, st.finished_at - st.queued_at))
        self._prompt_total += result.stats.prompt_tokens
        self._cached_total += result.stats.cached_tokens

    def on_snapshot(self, snapshot: dict) -> None:
        self._snapshot = snapshot  # replaced whole, read by the scrape thread

    # -- serving ---------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "127.0.0.1", health=None) -> int:
        """Serve /metrics, and /health and /ready when given ``health`` (a ``WorkerHealth``), on a daemon
        thread; returns the port (pass 0 for a free one).  Loopback unless ``addr`` says otherwise
        (`mlxq worker --metrics-host 0.0.0.0`)."""
        server_class = type("Server", (_ThreadingServer,), {"address_family": _family(addr, port)})
        self._server = make_server(addr, port, _app(self.registry, health), server_class, handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, name="mlxq-metrics", daemon=True).start()
        port = self._server.server_port
        log.info("metrics on http://%s:%d/metrics%s", addr, port, ", health on /health and /ready" if health else "")
        return port

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._collector.release()


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress does not hold the process at exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - a scrape a second is no log line
        pass


def _family(addr: str, port: int) -> int:
    """IPv4 or IPv6, as ``addr`` is written (``::`` binds every interface in IPv6)."""
    return socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]


def _app(registry: CollectorRegistry, health):
    """The metrics server's WSGI app: /health and /ready as JSON, every other path the metrics."""
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if health is None or path not in ("/health", "/ready"):
            return metrics(environ, start_response)
        code, body = health.health() if path == "/health" else health.ready()
        data = json.dumps(body).encode()
        start_response(f"{code} {HTTPStatus(code).phrase}",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]

    return app


class _ScrapeCollector:
    """Values read at scrape time: queue depth (Redis) and the worker snapshot.

    Queue depth and running jobs are figures of the model's queue, not of this process.  Prometheus
    labels every series with the ``instance`` it scraped, so when every worker (and the gateway)
    exported them, ``sum(mlxq_queue_depth)`` counted the queue once per exporter.  As with
    redis_exporter or rq-exporter, a value about a shared resource is exported by one process: here
    the worker that holds the model's exporter lease (``depth_exporter``, taken at a scrape when
    free, renewed at each of its scrapes), so ``sum by (model, tier)`` is right with any number of
    workers, and the lease moves to another scraped worker when its holder stops."""

    def __init__(self, metrics: WorkerMetrics, redis_client, keys):
        self.m = metrics
        self.redis = redis_client
        self.keys = keys
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # who holds the lease

    def describe(self):
        return []  # no describe: the collector is not run at registration

    def exporter(self) -> bool:
        """This process exports the model's queue figures now (takes or renews the lease)."""
        return bool(self.redis.eval(_LEASE, 1, self.keys.depth_exporter, self.token, int(EXPORTER_LEASE_S * 1000)))

    def release(self) -> None:
        """Hand the lease on at once (a worker that stops), rather than after ``EXPORTER_LEASE_S``."""
        try:
            self.redis.eval(_RELEASE, 1, self.keys.depth_exporter, self.token)
        except Exception as exc:  # noqa: BLE001 - it runs out by itself
            log.info("metrics: could not hand the queue-depth lease on: %s", exc)

    def collect(self):
        model = self.m.model
        depth = GaugeMetricFamily("mlxq_queue_depth", "Jobs waiting in the queue, per tier (exported by one "
                                  "worker of the model: sum by model and tier)", labels=["model", "tier"])
        running = GaugeMetricFamily("mlxq_running_jobs", "Jobs leased to workers (exported by one worker of "
                                    "the model)", labels=["model"])
        tokens = GaugeMetricFamily("mlxq_key_tokens_today", "Tokens of each API key's finished jobs this UTC day, "
                                   "by key name (exported by one worker of the model)", labels=["model", "key", "kind"])
        try:
            if self.exporter():
                counts = {k.decode(): int(v) for k, v in self.redis.hgetall(self.keys.counts).items()}
                for tier in TIERS:
                    depth.add_metric([model, tier], counts.get(f"queued:{tier}", 0))
                running.add_metric([model], counts.get("running", 0))
                # by the key's name (never the key or its hash), as `mlxq usage` reports it
                today: dict[tuple[str, str], int] = {}  # (keys used in open mode share "unregistered")
                for row in apikeys.usage(self.redis, GlobalKeys(self.keys.prefix), 1, [model]):
                    for kind in ("prompt", "completion"):
                        today[row["key"], kind] = today.get((row["key"], kind), 0) + row[f"{kind}_tokens"]
                for (key, kind), n in sorted(today.items()):
                    tokens.add_metric([model, key, kind], n)
        except Exception as exc:  # a scrape must not fail because Redis blinked
            log.warning("metrics: queue depth unavailable: %s", exc)
        yield depth
        yield running
        yield tokens

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
        if snap.get("engine_draft_proposed"):  # speculative decoding ran (--speculate)
            for name, key, doc in (("mlxq_draft_proposed_tokens", "engine_draft_proposed",
                                    "Tokens proposed by speculative decoding and verified"),
                                   ("mlxq_draft_accepted_tokens", "engine_draft_accepted",
                                    "Proposed tokens the verify passes accepted")):
                c = CounterMetricFamily(name, doc, labels=["model"])
                c.add_metric([model], snap[key])
                yield c
            yield _gauge("mlxq_draft_acceptance_rate", "Share of proposed tokens accepted (speculative decoding)",
                         model, snap["engine_draft_accepted"] / snap["engine_draft_proposed"])
        hits, prompt = snap.get("engine_prefix_hit_tokens"), snap.get("engine_prompt_tokens")
        if hits is None or not prompt:  # no engine figures: use finished jobs' stats
            hits, prompt = self.m._cached_total, self.m._prompt_total
        yield _gauge("mlxq_prefix_hit_rate", "Share of prompt tokens served from the prefix cache", model,
                     hits / prompt if prompt else 0.0)


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["model"])
    g.add_metric([model], float(value))
    return g
