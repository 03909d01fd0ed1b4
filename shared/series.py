"""The dashboard's rolling series: what each worker appends to its model's ``ModelKeys.series`` stream
(one point every ``series_interval_s``, the hour before trimmed at each append), and the charts read
from it.

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


def append(pipe, key: str, worker_id: str, p: dict, now_s: float, keep_s: float = KEEP_S) -> None:
    """Queue the XADD of point ``p`` on ``pipe``, trimming the entries older than ``keep_s`` (exactly: at a
    point per worker every few seconds, a trim removes one or two entries)."""
    pipe.xadd(key, {"w": worker_id, "p": json.dumps(p, separators=(",", ":"))},
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


def chart(points: list[tuple[float, str, dict]], bin_s: float) -> dict[str, list]:
    """Columns for the plots, one row per ``bin_s`` bin that has points: ``t`` (bin start, s),
    ``tok_s``, ``jobs_per_min`` (done + failed), ``queued_<tier>``, and the four quantiles (s; None where
    no job ended)."""
    bins: dict[int, list[tuple[float, dict]]] = {}
    for t, _worker, p in points:
        bins.setdefault(int(t // bin_s), []).append((t, p))
    cols: dict[str, list] = {"t": [], "tok_s": [], "jobs_per_min": [], **{f"queued_{t}": [] for t in TIERS},
                             **{q: [] for q in QUANTILES}}
    for b in sorted(bins):
        rows = sorted(bins[b], key=lambda tp: tp[0])
        # each worker's point covers its own interval; a bin holds about one interval of each worker
        span = max(bin_s, max(_num(p.get("s")) for _, p in rows))
        cols["t"].append(b * bin_s)
        cols["tok_s"].append(round(sum(_num(p.get("tokens")) for _, p in rows) / span, 3))
        cols["jobs_per_min"].append(round(60 * sum(_num(p.get("done")) + _num(p.get("failed")) for _, p in rows)
                                          / span, 3))
        latest = rows[-1][1].get("queued") if isinstance(rows[-1][1].get("queued"), dict) else {}
        for tier in TIERS:
            cols[f"queued_{tier}"].append(_num(latest.get(tier)))
        for q in QUANTILES:
            seen = [_num(p.get(q)) for _, p in rows if p.get(q) is not None]
            cols[q].append(max(seen) if seen else None)
    return cols


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else 0.0
