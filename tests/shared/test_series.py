"""The dashboard's rolling series (shared/series.py, worker/series.py) on fakeredis: points written by
two workers read back as charts, trimmed to the hour, malformed entries skipped."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from mlxq.shared import series
from mlxq.shared.keys import ModelKeys
from mlxq.worker.series import SeriesPoints

K = ModelKeys("m")


def add(r, worker, t, **p):
    """A point as a worker writes it, at time ``t`` (the stream id; a worker's XADD takes the server's)."""
    r.xadd(K.series, {"w": worker, "p": json.dumps(series.point(10.0, queued={}, ttfts=[], waits=[], **p))},
           id=f"{int(t * 1000)}-0")


def test_two_workers_add_up_and_the_hour_before_is_trimmed(fake_redis):
    now = time.time()
    b = (now // 10) * 10 - 40  # the start of a 10 s bin, the three points below in it and the next
    add(fake_redis, "w1", now - 2 * series.KEEP_S, tokens=999, done=9, failed=0)  # trimmed by the next append
    add(fake_redis, "w1", b + 1, tokens=100, done=2, failed=1)
    add(fake_redis, "w2", b + 2, tokens=50, done=1, failed=0)
    add(fake_redis, "w1", b + 11, tokens=30, done=0, failed=0)
    fake_redis.xadd(K.series, {"w": "w3", "p": "not json"})  # skipped
    pipe = fake_redis.pipeline(transaction=False)
    series.append(pipe, K.series, "w2", series.point(10.0, 0, 0, 0, {"low": 4}, [0.5], [1.0]), now)
    pipe.execute()
    assert fake_redis.xlen(K.series) == 5
    points = series.read(fake_redis, K.series, now + 1)
    assert sorted(w for _, w, _ in points) == ["w1", "w1", "w2", "w2"]
    cols = series.chart([p for p in points if p[0] < b + 20], 10.0)
    assert cols["t"] == [b, b + 10]
    assert cols["tok_s"] == [15.0, 3.0] and cols["jobs_per_min"] == [24.0, 0.0]
    assert cols["ttft_p50"] == [None, None]
    last = series.chart(points[-1:], 10.0)
    assert last["queued_low"] == [4.0] and last["ttft_p95"] == [0.5] and last["wait_p50"] == [1.0]


def test_a_workers_point_counts_its_interval_and_starts_again():
    sp = SeriesPoints(10.0)
    assert sp.due()
    job = SimpleNamespace()
    for i, ttft in enumerate((0.1, 0.2, 0.3, 4.0)):
        sp.on_token(job, 3, 0.0)
        sp.on_finish(job, SimpleNamespace(finish_reason="error" if i == 3 else "stop",
                                          stats=SimpleNamespace(ttft_s=ttft, queue_wait_s=ttft / 2)))
    p = sp.take({"high": 1, "normal": 2})
    assert (p["tokens"], p["done"], p["failed"]) == (12, 3, 1)
    assert p["queued"] == {"high": 1, "normal": 2, "low": 0}
    assert p["ttft_p50"] == 0.2 and p["ttft_p95"] == 4.0 and p["wait_p95"] == 2.0
    assert not sp.due()
    again = sp.take({})
    assert (again["tokens"], again["done"], again["ttft_p50"]) == (0, 0, None)


def test_quantile_nearest_rank():
    assert series.quantile([], 0.5) is None
    assert series.quantile([3.0], 0.95) == 3.0
    assert series.quantile(list(range(1, 101)), 0.95) == 95


def test_gateways_requests_add_up_and_their_ttft_takes_the_worst():
    points = [(100.0, "g1", series.gateway_point(10.0, 30, 1, [0.1, 0.2])),
              (101.0, "g2", series.gateway_point(10.0, 10, 0, [0.5])),
              (111.0, "g1", series.gateway_point(10.0, 0, 0, []))]
    cols = series.gateway_chart(points, 10.0)
    assert cols["t"] == [100.0, 110.0]
    assert cols["requests_per_min"] == [240.0, 0.0] and cols["errors_per_min"] == [6.0, 0.0]
    assert cols["ttft_p50"] == [0.5, None] and cols["ttft_p95"] == [0.5, None]
