"""The dashboard's rolling series: what each worker appends to its model's ``ModelKeys.series`` stream
and each gateway to ``GlobalKeys.gateway_series`` (one point every ``series_interval_s``, the hour
before trimmed at each append), and the charts read from them.

The workers write them as they run, so the plots are full when the page first opens, whoever opens
it. A point covers the worker's last interval: tokens generated, jobs ended (done, failed), the TTFT
and queue wait p50/p95 of the jobs that ended in it, and the queue depth by tier when it was written.
Reading bins the points of every worker by time: throughput and jobs add up across workers; queue
depth (the same queue, seen by each) takes the latest; quantiles take the worst worker's.
"""

from __future__ import annotations

import json
import math
from typing import Optional, Sequence

from .settings import TIERS

KEEP_S = 3600.0  # an hour
QUANTILES = ("ttft_p50", "ttft_p95", "wait_p50", "wait_p95")


def quantile(values: Sequence[float], q: float) -> Optional[float]:
    """The ``q`` quantile of ``values`` (nearest rank), None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def point(interval_s: float, tokens: int, done: int, failed: int, queued: dict, ttfts: Sequence[float],
          waits: Sequence[float]) -> dict:
    """One worker's point over its last ``interval_s``."""
    return {"s": round(interval_s, 3), "tokens": tokens, "done": done, "failed": failed,
            "queued": {t: int(queued.get(t, 0)) for t in TIERS},
            "ttft_p50": quantile(ttfts, 0.5), "ttft_p95": quantile(ttfts, 0.95),
            "wait_p50": quantile(waits, 0.5), "wait_p95": quantile(waits, 0.95)}


def append(pipe, key: str, worker_id: str, p: dict, now_s: float, keep_s: float = KEEP_S):
    """The XADD of point ``p`` on ``pipe`` (a pipeline, or a client: an asyncio one's is awaited), trimming the entries older than ``keep_s`` (exactly: at a
    point per worker every few seconds, a trim removes one or two entries)."""
    return pipe.xadd(key, {"w": worker_id, "p": json.dumps(p, separators=(",", ":"))},
              minid=f"{int((now_s - keep_s) * 1000)}-0", approximate=False)


def read(redis, key: str, now_s: float, keep_s: float = KEEP_S) -> list[tuple[float, str, dict]]:
    """``(time s, worker id, point)`` of the last ``keep_s``; malformed entries skipped."""
    out = []
    for entry_id, fields in redis.xrange(key, min=f"{int((now_s - keep_s) * 1000)}-0"):
        try:
            t = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0]) / 1000.0
            f = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
            p = json.loads(f["p"])
            worker = f["w"].decode() if isinstance(f["w"], bytes) else str(f["w"])
        except (KeyError, ValueError, TypeError, AttributeError):
            continue
        if isinstance(p, dict):
            out.append((t, worker, p))
    return out


def _bins(points: list[tuple[float, str, dict]], bin_s: float):
    """``(bin start, its points oldest first, the time they cover)`` of each ``bin_s`` bin that has points:
    each writer's point covers its own interval, and a bin holds about one interval of each."""
    bins: dict[int, list[tuple[float, dict]]] = {}
    for t, _writer, p in points:
        bins.setdefault(int(t // bin_s), []).append((t, p))
    for b in sorted(bins):
        rows = [p for _, p in sorted(bins[b], key=lambda tp: tp[0])]
        yield b * bin_s, rows, max(bin_s, max(_num(p.get("s")) for p in rows))


def _rate(rows: list[dict], fields: tuple[str, ...], span: float, per_s: float = 1.0) -> float:
    return round(per_s * sum(_num(p.get(f)) for p in rows for f in fields) / span, 3)


def _worst(rows: list[dict], name: str) -> Optional[float]:
    seen = [_num(p.get(name)) for p in rows if p.get(name) is not None]
    return max(seen) if seen else None


def chart(points: list[tuple[float, str, dict]], bin_s: float) -> dict[str, list]:
    """The workers' columns for the plots, one row per ``bin_s`` bin that has points: ``t`` (bin start, s),
    ``tok_s``, ``jobs_per_min`` (done + failed), ``queued_<tier>``, and the four quantiles (s; None where
    no job ended)."""
    cols: dict[str, list] = {"t": [], "tok_s": [], "jobs_per_min": [], **{f"queued_{t}": [] for t in TIERS},
                             **{q: [] for q in QUANTILES}}
    for start, rows, span in _bins(points, bin_s):
        cols["t"].append(start)
        cols["tok_s"].append(_rate(rows, ("tokens",), span))
        cols["jobs_per_min"].append(_rate(rows, ("done", "failed"), span, 60))
        latest = rows[-1].get("queued") if isinstance(rows[-1].get("queued"), dict) else {}
        for tier in TIERS:
            cols[f"queued_{tier}"].append(_num(latest.get(tier)))
        for q in QUANTILES:
            cols[q].append(_worst(rows, q))
    return cols


def gateway_point(interval_s: float, requests: int, errors: int, ttfts: Sequence[float]) -> dict:
    """One gateway's point over its last ``interval_s``: API requests answered, those answered with a
    5xx, and the time to the first streamed token (as the client sees it) p50/p95."""
    return {"s": round(interval_s, 3), "requests": requests, "errors": errors,
            "ttft_p50": quantile(ttfts, 0.5), "ttft_p95": quantile(ttfts, 0.95)}


def gateway_chart(points: list[tuple[float, str, dict]], bin_s: float) -> dict[str, list]:
    """The gateways' columns: ``t``, ``requests_per_min``, ``errors_per_min`` (added over gateways), and
    ``ttft_p50``/``ttft_p95`` (the worst gateway's)."""
    cols: dict[str, list] = {"t": [], "requests_per_min": [], "errors_per_min": [], "ttft_p50": [], "ttft_p95": []}
    for start, rows, span in _bins(points, bin_s):
        cols["t"].append(start)
        cols["requests_per_min"].append(_rate(rows, ("requests",), span, 60))
        cols["errors_per_min"].append(_rate(rows, ("errors",), span, 60))
        for q in ("ttft_p50", "ttft_p95"):
            cols[q].append(_worst(rows, q))
    return cols


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else 0.0
