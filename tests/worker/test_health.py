"""Health that means something, against a real Valkey: the gateway's /health (liveness: no key, no
Redis) and /ready (Redis and a live worker), the worker's /health beside its metrics (its watchdog),
SSE keep-alive comments while a stream waits in the queue, the queue depth exported by one worker per
model, and JSON log lines.  No assertion depends on how fast anything runs."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
from urllib.parse import urlparse

import redis
from prometheus_client.parser import text_string_to_metric_families

from mlxq import Client
from mlxq.producer.gateway import ServerThread, create_app
from mlxq.shared.embedded import EmbeddedRedis
from mlxq.shared.keys import GlobalKeys
from mlxq.worker.health import WorkerHealth
from mlxq.worker.metrics import WorkerMetrics
from mlxq.worker.watchdog import Watchdog
from workerkit import fast_settings, neutral_cwd, running_worker, wait_for

GK = GlobalKeys()


def get(base: str, path: str, timeout: float = 30) -> tuple[int, dict]:
    """GET ``path`` with no Authorization header: (status, JSON body)."""
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def test_gateway_health_stays_200_and_ready_says_503_while_redis_is_down():
    server, up = EmbeddedRedis().start(), True
    try:
        settings = fast_settings(server.url, ready_timeout_s=1.0)
        with ServerThread(create_app(server.url, settings)) as url:
            code, body = get(url, "/ready")
            assert code == 503 and body["redis"] == "ok" and body["reason"] == "no model is registered"
            server.stop()
            up = False
            assert get(url, "/health") == (200, {"status": "ok"})
            code, body = get(url, "/ready")
            assert code == 503 and body["status"] == "not ready" and "Redis" in body["reason"], body
            assert get(url, "/health")[0] == 200
    finally:
        if up:
            server.stop()


def test_ready_needs_a_live_worker_and_a_waiting_stream_gets_keepalives_then_its_tokens(tiny_model, redis_url):
    """A low-tier stream (/v1/batch/) queued while no worker runs: the headers go out with a
    keep-alive comment, then the tokens once a worker starts (the same text as a plain request's);
    one the worker refuses ends with an error event instead."""
    settings = fast_settings(redis_url, sse_keepalive_s=1.0, ready_timeout_s=5.0)
    r = redis.Redis.from_url(redis_url)
    with ServerThread(create_app(redis_url, settings)) as url:
        with running_worker(tiny_model, redis_url, settings):
            assert wait_for(lambda: get(url, "/ready")[0] == 200, timeout=60)
            code, body = get(url, "/ready")
            assert code == 200 and body == {"status": "ready", "redis": "ok", "models": 1, "live_workers": 1}
        assert wait_for(lambda: get(url, "/ready")[0] == 503, timeout=60)
        assert get(url, "/ready")[1]["reason"] == "no live worker for any of 1 models"

        body = {"model": "tiny", "messages": [{"role": "user", "content": "keep me alive"}], "max_tokens": 4,
                "stream": True}
        served, served_lines = _queued_stream(url, body)
        # more tokens than the next worker's KV memory can ever hold: refused once the headers are out
        refused, refused_lines = _queued_stream(url, {**body, "max_tokens": 400})
        queued = [m.decode().rsplit(":", 1)[-1] for m in r.zrange(GK.model_keys("tiny").queue, 0, -1)]
        assert [r.hget(GK.model_keys("tiny").job(j), "tier") for j in queued] == [b"low", b"low"]
        from mlxq.worker.engine import PagedEngine

        small = PagedEngine(tiny_model.model, num_blocks=4, eos_token_ids=tiny_model.eos_token_ids, model_id="tiny")
        with running_worker(tiny_model, redis_url, settings, engine=small):
            lines = _read_until(served, served_lines, "data: [DONE]")
            refused_lines = _read_until(refused, refused_lines, "")  # the server ends the stream
            served.close()
            refused.close()
            ref = Client(redis_url, model="tiny", settings=settings).submit(
                messages=body["messages"], max_tokens=4).result(timeout=60)
    r.close()
    chunks = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    assert all("error" not in c for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == ref.text
    assert chunks[-1]["choices"][0]["finish_reason"] == ref.finish_reason
    # the refusal, after the headers: OpenAI's error chunk (the 400 it would have been), and no [DONE]
    events = [json.loads(line[len("data: "):]) for line in refused_lines if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "invalid_request" and "never fit" in events[-1]["error"]["message"]
    assert "data: [DONE]" not in refused_lines


def _queued_stream(url: str, body: dict):
    """POST a low-tier (/v1/batch/) stream and read up to its first keep-alive comment: (the
    response, its lines so far); nothing but the role chunk before it (no token: no worker runs)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", "/v1/batch/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    lines = _read_until(resp, [], ": keep-alive")
    before = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data:")]
    assert [c["choices"][0]["delta"] for c in before] == [{"role": "assistant", "content": ""}]
    return resp, lines


def _read_until(resp, lines: list, last: str) -> list:
    """Read SSE lines (blank ones dropped) until ``last``; "": until the stream ends."""
    while True:
        raw = resp.readline()
        line = raw.decode().strip()
        if line:
            lines.append(line)
        if (last and line == last) or not raw:
            assert line == last, lines
            return lines


def test_worker_health_fails_while_its_engine_is_stuck(tiny_model, redis_url):
    """The engine's step never returns (as a hung kernel's): the watchdog (stall_s 1) turns the
    worker's /health and /ready to 503 with its reason.  The process would exit (code 70); here
    the test keeps it to read the endpoint, then lets the step go."""
    settings = fast_settings(redis_url, stall_s=1.0)
    r = redis.Redis.from_url(redis_url)
    metrics = WorkerMetrics(r, GK.model_keys("tiny"), "tiny")
    frozen, release = threading.Event(), threading.Event()
    try:
        with running_worker(tiny_model, redis_url, settings, observers=[metrics]) as w:
            w.control.heartbeat.exit = lambda code: None
            base = f"http://127.0.0.1:{metrics.serve(0, health=WorkerHealth.of(w))}"
            assert get(base, "/health") == (200, {"status": "ok"})
            assert get(base, "/ready") == (200, {"status": "ready"})
            step = w.engine.step

            def stuck_step():
                frozen.set()
                release.wait()
                return step()

            w.engine.step = stuck_step
            job = Client(redis_url, model="tiny", settings=settings).submit("stuck", max_tokens=2)
            assert frozen.wait(60)
            assert wait_for(lambda: get(base, "/health")[0] == 503, timeout=60)
            code, body = get(base, "/health")
            assert body["status"] == "stuck" and "no engine step completed" in body["reason"]
            assert get(base, "/ready")[0] == 503
            w.engine.step = step
            release.set()
            job.cancel()
    finally:
        release.set()
        metrics.shutdown()
        r.close()


def test_worker_ready_fails_while_it_drains():
    draining = threading.Event()
    health = WorkerHealth(Watchdog(60.0), draining)
    assert health.ready() == (200, {"status": "ready"})
    draining.set()
    code, body = health.ready()
    assert code == 503 and body["status"] == "draining"
    assert health.health() == (200, {"status": "ok"})  # alive: finishing its jobs


def test_queue_depth_is_exported_by_one_worker_per_model_and_handed_on(redis_url):
    r = redis.Redis.from_url(redis_url)
    keys = GK.model_keys("tiny")
    r.hset(keys.counts, mapping={"queued:low": 3, "running": 2})
    a, b = WorkerMetrics(r, keys, "tiny"), WorkerMetrics(r, keys, "tiny")

    def figures(m: WorkerMetrics) -> dict:
        out = {}
        for fam in m.registry.collect():
            if fam.name in ("mlxq_queue_depth", "mlxq_running_jobs"):
                out.update({(s.name, s.labels.get("tier")): s.value for s in fam.samples})
        return out

    try:
        first, second = figures(a), figures(b)
        assert first == {("mlxq_queue_depth", "high"): 0, ("mlxq_queue_depth", "normal"): 0,
                         ("mlxq_queue_depth", "low"): 3, ("mlxq_running_jobs", None): 2}
        assert second == {}  # the same queue: exported once, so sum() counts it once
        assert figures(a) == first  # the holder keeps it from one scrape to the next
        a.shutdown()  # a worker that stops hands it on
        assert figures(b) == first
    finally:
        a.shutdown()
        b.shutdown()
        r.close()


def test_latency_histograms_carry_the_tier():
    from types import SimpleNamespace

    import fakeredis

    m = WorkerMetrics(fakeredis.FakeRedis(), GK.model_keys("m"), "m")
    job = SimpleNamespace(id="j", sample=None, uid="j", group=None, first_token_at=2.0, queued_at=1.0, tier="low")
    m.on_token(job, 1, 2.0)
    m.on_token(job, 1, 2.5)
    m.on_finish(job, SimpleNamespace(finish_reason="length", stats=SimpleNamespace(
        prompt_tokens=3, cached_tokens=0, queue_wait_s=0.5, queued_at=1.0, finished_at=3.0)))
    counts = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in m.registry.collect()
              for s in fam.samples if s.name.endswith("_count")}
    low = (("model", "m"), ("tier", "low"))
    assert counts[("mlxq_ttft_seconds_count", low)] == 1
    assert counts[("mlxq_inter_token_latency_seconds_count", low)] == 1
    assert counts[("mlxq_queue_wait_seconds_count", low)] == 1
    assert counts[("mlxq_end_to_end_seconds_count", (("model", "m"), ("reason", "length"), ("tier", "low")))] == 1


def test_json_log_lines_from_the_cli_parse(redis_url):
    """Every command logs through shared/logs.py: an unknown MLXQ_ variable's warning, as JSON."""
    env = {**os.environ, "MLXQ_NOT_A_SETTING": "1", "MLXQ_LOG_FORMAT": "json"}
    out = subprocess.run([sys.executable, "-m", "mlxq", "stats", "--json", "--redis-url", redis_url],
                         capture_output=True, text=True, env=env, cwd=neutral_cwd(), timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.strip()]
    assert any(line["level"] == "WARNING" and "MLXQ_NOT_A_SETTING" in line["message"] for line in lines), lines
    assert all({"ts", "level", "logger", "message"} <= set(line) for line in lines)


def test_a_json_line_about_a_job_carries_its_id_and_attempt_however_it_was_logged():
    import logging

    from mlxq.shared.logs import JsonFormatter

    def line(msg, *args, **extra):
        record = logging.LogRecord("mlxq.worker.runner", logging.WARNING, __file__, 1, msg, args, None)
        record.__dict__.update(extra)
        return json.loads(JsonFormatter().format(record))

    worker = line("job=%s attempt=%d refused: %s", "ab" * 16, 2, "too long")  # the worker's plain lines
    assert (worker["job"], worker["attempt"], worker["level"]) == ("ab" * 16, 2, "WARNING")
    assert line("job=x attempt=0 z", job="given", attempt=3)["job"] == "given"  # extra= wins
    assert "job" not in line("serving %r", "tiny")
