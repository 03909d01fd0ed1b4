"""What the dashboard's pages show, read from Redis (no HTTP here): the overview of models and workers,
the rolling series, a job's page and its output, batches and keys. Every figure comes from what the
workers, the scripts and the gateway already keep; nothing shows an API key or its hash."""

from __future__ import annotations

import json
import time
from typing import Optional

from ...shared import apikeys, codec, series
from ...shared.codec import text as _s
from ...shared.keys import GlobalKeys
from ...shared.settings import TIERS
from ..records import TERMINAL, StreamState, entry_deltas
from ..stats import collect

PROMPT_CHARS = 2000  # a job page shows at most this much of a prompt
VALUE_CHARS = 300  # and of any other request parameter


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + f"... ({len(text) - n} more characters)"


def server_now(r) -> float:
    sec, usec = r.time()
    return int(sec) + int(usec) / 1e6


def overview(r, prefix: str) -> dict:
    """``{models: [...], workers: [...]}``: per model its queue by tier, running, done and failed in the
    last hour (from the series), tokens/s; per worker its heartbeat age, batch, KV blocks, prefix hits,
    memory, preemptions and version."""
    gk = GlobalKeys(prefix)
    now = time.time()
    models, workers = [], []
    for name, agg in collect(r, prefix).items():
        points = series.read(r, gk.model_keys(name).series, server_now(r))
        models.append({"name": name, "queued": agg["queued"], "deferred": agg["deferred"], "running": agg["running"],
                       "done_hour": sum(int(p.get("done") or 0) for _, _, p in points),
                       "failed_hour": sum(int(p.get("failed") or 0) for _, _, p in points),
                       "dead": agg["dead"], "tok_s": agg["tok_s_current"], "workers": len(agg["workers"])})
        for w in agg["workers"]:
            workers.append(worker_row(name, w, now))
    gateways = len({g for _, g, _ in series.read(r, gk.gateway_series, server_now(r))})
    return {"models": models, "workers": workers, "gateways": gateways}


def worker_row(model: str, w: dict, now: float) -> dict:
    """One worker's heartbeat record (its stats snapshot) as the overview's row."""
    hits, prompt = w.get("engine_prefix_hit_tokens"), w.get("engine_prompt_tokens")
    return {"model": model, "id": str(w.get("worker_id", "?")), "age_s": max(0.0, now - float(w.get("updated_at") or 0)),
            "active": w.get("active", 0), "running": w.get("engine_running"), "waiting": w.get("engine_waiting"),
            "blocks_used": w.get("engine_blocks_used"), "blocks_free": w.get("engine_blocks_free"),
            "blocks_total": w.get("engine_blocks_total"),
            "prefix_hit": hits / prompt if isinstance(hits, (int, float)) and prompt else None,
            "memory_mib": (w.get("active_memory_bytes") or 0) / 2**20,
            "peak_mib": (w.get("peak_memory_bytes") or 0) / 2**20,
            "preemptions": w.get("engine_preemptions"), "version": w.get("version", "-"),
            "tok_s": w.get("tok_s_current", 0.0), "draining": bool(w.get("draining"))}


def chart(r, prefix: str, model: str, bin_s: float = 10.0) -> dict:
    """The model's last hour as plot columns (shared/series.chart)."""
    key = GlobalKeys(prefix).model_keys(model).series
    return series.chart(series.read(r, key, server_now(r)), bin_s)


def gateway_chart(r, prefix: str, bin_s: float = 10.0) -> dict:
    """The gateways' last hour as plot columns (shared/series.gateway_chart)."""
    return series.gateway_chart(series.read(r, GlobalKeys(prefix).gateway_series, server_now(r)), bin_s)


def job_page(admin, job_id: str) -> dict:
    """A job's parameters (prompt clipped), timings, attempts, ending, for its page."""
    shown = admin.show(job_id)
    req = shown.get("request")
    params, prompt = {}, None
    if isinstance(req, dict):
        for k, v in req.items():
            if k in ("prompt", "messages", "input"):
                prompt = _clip(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=repr),
                               PROMPT_CHARS)
            else:
                params[str(k)] = _clip(json.dumps(v, ensure_ascii=False, default=repr), VALUE_CHARS)
    elif req is not None:
        prompt = _clip(str(req), PROMPT_CHARS)
    result = shown.get("result") if isinstance(shown.get("result"), dict) else {}
    times = {}
    for name in ("queued_at", "started_at", "finished_at"):
        try:
            times[name] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(shown[name]))) + " UTC"
        except (KeyError, ValueError):
            times[name] = "-"
    return {"id": job_id, "queue": shown["queue"], "status": shown.get("status", "?"), "tier": shown.get("tier", "-"),
            "attempts": shown.get("attempts", "0"), "prompt": prompt, "params": params, "times": times,
            "finish_reason": result.get("finish_reason"), "error": result.get("error") or shown.get("error"),
            "done": shown.get("status") in TERMINAL}


def job_live(admin, job_id: str) -> dict:
    """What a job's page refreshes: its fields as ``job_page`` reads them, and its output so far."""
    page = job_page(admin, job_id)
    out = job_output(admin.r, admin.settings.prefix, page["queue"], job_id)
    return {"status": page["status"], "attempts": page["attempts"], "times": page["times"],
            "finish_reason": page["finish_reason"] or out.get("finish_reason"),
            "error": page["error"] or out.get("error"), "text": out["text"], "done": page["done"]}


def job_output(r, prefix: str, queue: str, job_id: str) -> dict:
    """The job's text so far and its status. A running job's from its durable record (the stream every
    worker appends to, read whole so that a retried or resumed job's overlapping deltas count once); an
    ended one's from its result, which has all of it (at the end the stream is folded into the record:
    shared/replay.py). The status is read first, so an ended job's text is never a stream read short."""
    k = GlobalKeys(prefix).model_keys(queue)
    status = _s(r.hget(k.job(job_id), "status") or b"?")
    ending: dict = {}
    if status in TERMINAL:
        raw = r.hget(k.job(job_id), "result")
        try:
            res = codec.unpack(raw) if raw else {}
        except Exception:  # noqa: BLE001 - a result written badly: say so, do not fail the page
            res = {"error": "the job's result is not readable"}
        res = res if isinstance(res, dict) else {}
        return {"status": status, "text": res.get("text") or "", "done": True,
                **{f: res[f] for f in ("finish_reason", "error") if res.get(f)}}
    state = StreamState()
    texts: dict[int, list[str]] = {}
    for _id, fields in r.xrange(k.events(job_id)):
        for d in state.feed_all(entry_deltas(fields)):
            texts.setdefault(d.sample or 0, []).append(d.text or "")
            if d.finish_reason and d.attempt == -1:  # a terminal event (cancel, dead letter)
                ending = {"finish_reason": d.finish_reason, "error": d.error}
    return {"status": status, "text": "".join(texts.get(0, [])), "done": False, **ending}


def batches(r, prefix: str) -> list[dict]:
    """The batches not yet ended (any gateway's driver runs them), each with its progress."""
    gk = GlobalKeys(prefix)
    out = []
    for raw_id in sorted(r.smembers(gk.batches_active)):
        bk = gk.batch(_s(raw_id))
        meta = {}
        for k, v in r.hgetall(bk.meta).items():
            try:
                meta[_s(k)] = json.loads(v)
            except ValueError:
                continue
        counts = meta.get("request_counts") if isinstance(meta.get("request_counts"), dict) else {}
        total = int(counts.get("total") or 0)
        answered, failed = r.hlen(bk.results), r.hlen(bk.failed)
        out.append({"id": _s(raw_id), "status": meta.get("status", "?"), "endpoint": meta.get("endpoint", "-"),
                    "total": total, "completed": answered - failed, "failed": failed,
                    "percent": round(100 * answered / total) if total else 0})
    return out


def keys(r, prefix: str, settings_models: Optional[list[str]] = None) -> list[dict]:
    """Each registered key by name (never the key or its hash): tier, role, limits, today's tokens and
    jobs, and its jobs in flight now."""
    gk = GlobalKeys(prefix)
    names = apikeys.key_names(r, gk)
    running: dict[str, int] = {}
    models = settings_models if settings_models is not None else sorted(_s(m) for m in r.hkeys(gk.models))
    for model in models:
        # (the hash also holds an entry per queued job: scanned for the in-flight counts only)
        for field, value in r.hscan_iter(gk.model_keys(model).fair_state, match="run:*", count=1000):
            name = names.get(_s(field)[4:], "unregistered")
            running[name] = running.get(name, 0) + int(value)
    today: dict[str, dict] = {}
    for row in apikeys.usage(r, gk, 1, models):
        t = today.setdefault(row["key"], {"prompt_tokens": 0, "completion_tokens": 0, "jobs": 0})
        for f in t:
            t[f] += row[f]
    rows = []
    for k in apikeys.list_keys(r, gk):
        label = k["name"] or "unnamed"
        used = today.get(label, {})
        quota = k.get("daily_tokens")
        spent = used.get("prompt_tokens", 0) + used.get("completion_tokens", 0)
        rows.append({"name": label, "tier": k["tier"], "admin": k["admin"], "revoked": k["revoked"],
                     "max_inflight": k.get("max_inflight"), "daily_tokens": quota, "jobs_today": used.get("jobs", 0),
                     "tokens_today": spent, "quota_percent": min(100, round(100 * spent / quota)) if quota else None,
                     "inflight": running.get(label, 0)})
    return rows


TIER_NAMES = TIERS
