"""Aggregate stats of a model's queue and workers, as ``mlxq stats`` prints them."""

from __future__ import annotations

import time

from ..shared import codec
from ..shared.codec import text as _s
from ..shared.keys import GlobalKeys
from ..shared.settings import TIERS


def collect(redis, prefix: str = "mlxq") -> dict:
    """{model: {queued: {tier: n}, running, done, failed, cancelled, dead, processed, workers: [...], ...}}"""
    gk = GlobalKeys(prefix)
    models = [_s(m) for m in redis.hkeys(gk.models)]
    out = {}
    for model in sorted(models):
        k = gk.model_keys(model)
        counts = {_s(a): int(b) for a, b in redis.hgetall(k.counts).items()}
        workers = []
        for wid in redis.zrange(k.workers, 0, -1):
            blob = redis.hget(k.worker(_s(wid)), "s")
            if blob:
                snap = codec.unpack(blob)
                if isinstance(snap, dict) and snap:
                    workers.append(snap)
        agg = {
            "queued": {t: counts.get(f"queued:{t}", 0) for t in TIERS},
            "running": counts.get("running", 0),
            "submitted": counts.get("submitted", 0),
            "processed": counts.get("processed", 0),
            "done": counts.get("done", 0),
            "failed": counts.get("failed", 0),
            "cancelled": counts.get("cancelled", 0),
            "dead": counts.get("dead", 0),
            "expired": counts.get("expired", 0),
            "deferred": redis.zcard(k.deferred),  # waiting for their run_at, in no queue yet
            "requeued": counts.get("requeued", 0),
            "garbage": counts.get("garbage", 0),
            "inflight": redis.zcard(k.inflight),
            "workers": workers,
            "active": sum(w.get("active", 0) for w in workers),
            "active_by_tier": {t: sum((w.get("active_by_tier") or {}).get(t, 0) for w in workers) for t in TIERS},
            "tok_s_current": sum(w.get("tok_s_current", 0.0) for w in workers),
            "tok_s_avg": sum(w.get("tok_s_avg", 0.0) for w in workers),
            "tokens_generated": sum(w.get("tokens_generated", 0) for w in workers),
            "peak_memory_bytes": max((w.get("peak_memory_bytes", 0) for w in workers), default=0),
        }
        out[model] = agg
    return out


def render(stats: dict) -> str:
    if not stats:
        return "no models registered (no worker has started)"
    lines = []
    for model, a in stats.items():
        q = a["queued"]
        lines.append(f"model {model}")
        act = a["active_by_tier"]
        lines.append(f"  queued    high={q['high']} normal={q['normal']} low={q['low']}   running={a['running']}"
                     f"   deferred={a['deferred']}")
        lines.append(f"  active    high={act['high']} normal={act['normal']} low={act['low']}")
        lines.append(f"  processed {a['processed']} (done={a['done']} failed={a['failed']} "
                     f"cancelled={a['cancelled']} dead={a['dead']} expired={a['expired']})  requeued={a['requeued']}")
        lines.append(f"  tok/s     current={a['tok_s_current']:.1f} average={a['tok_s_avg']:.1f}   "
                     f"peak memory={a['peak_memory_bytes'] / 2**20:.1f} MiB")
        for w in a["workers"]:
            age = time.time() - w.get("updated_at", 0)
            extra = ""
            if "engine_blocks_total" in w:
                extra = (f" blocks used/cached/free/total={w.get('engine_blocks_used')}/{w.get('engine_blocks_cached')}/"
                         f"{w.get('engine_blocks_free')}/{w.get('engine_blocks_total')}")
            lines.append(f"  worker {w.get('worker_id')}: active={w.get('active')} "
                         f"tok/s={w.get('tok_s_current', 0):.1f} engine={w.get('engine')} ({age:.0f}s ago){extra}")
    return "\n".join(lines)
