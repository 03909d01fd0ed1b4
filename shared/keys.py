"""Every Redis key mlxq uses is built here, and only here.

All keys of one model's queue share the hash tag ``{<prefix>:<model>}``, so
every Lua script touches a single Redis Cluster slot.  A job's own keys carry
the same tag: enqueue, pull, cancel and completion stay atomic on a cluster.
The price: one model's queue lives on one cluster shard (see docs/operations/cluster.md).
"""

from __future__ import annotations

import hashlib
import re

from .settings import TIERS

_BAD_MODEL_CHARS = re.compile(r"[{}\s]")


def model_name(raw: str) -> str:
    """The queue name for a model directory, GGUF file or hub id (braces and spaces are not allowed)."""
    name = raw.rstrip("/")
    if name.lower().endswith(".gguf"):
        name = name.rsplit("/", 1)[-1][: -len(".gguf")]  # a GGUF file: its stem
    elif "/" in name and name.startswith(("/", ".", "~")):
        name = name.rsplit("/", 1)[-1]  # a local directory: its base name
    name = _BAD_MODEL_CHARS.sub("_", name)
    if not name:
        raise ValueError(f"empty model name from {raw!r}")
    return name


class GlobalKeys:
    """Keys that belong to no single model."""

    def __init__(self, prefix: str = "mlxq"):
        self.prefix = prefix

    @property
    def api_keys(self) -> str:  # hash: sha256(api key) -> tier | "revoked"
        return f"{self.prefix}:apikeys"

    @property
    def api_key_info(self) -> str:  # hash: sha256(api key) -> JSON {name, admin, created}: what `keys list` shows
        return f"{self.prefix}:apikeys:info"

    @property
    def policy(self) -> str:  # hash: offset:<tier> -> seconds, max_queued, anonymous (set by `mlxq tiers`)
        return f"{self.prefix}:policy"

    @property
    def policy_version(self) -> str:  # string: bumped on every key or policy change (slot copies follow it)
        return f"{self.prefix}:policy:version"

    @property
    def policy_models(self) -> str:  # set: models whose slot holds a copy of the registry and policy
        return f"{self.prefix}:policy:models"

    @property
    def models(self) -> str:  # hash: model name -> msgpack model info (served by live workers)
        return f"{self.prefix}:models"

    @property
    def rq_intake(self) -> str:  # list: rq job ids taken from rq queues, not yet enqueued in mlxq
        return f"{self.prefix}:rqbridge:intake"

    @property
    def rq_pending(self) -> str:  # hash: rq job id -> msgpack {model, job} of a bridged job not yet mirrored back
        return f"{self.prefix}:rqbridge:pending"

    @property
    def webhook_secrets(self) -> str:
        """hash: sha1(sha256(api key)) (the slot copies' field) | "anonymous" -> the Standard Webhooks
        secret (whsec_<base64>) that signs the webhooks of that key's jobs (`mlxq keys webhook-secret`)."""
        return f"{self.prefix}:webhooksecrets"

    @property
    def bulk_webhooks(self) -> str:
        """zset: bulk run id (an OpenAI batch's, a ``Client.map``'s) -> when its webhook's next attempt is
        due (0: at once); the webhook sender delivers and removes them (producer/webhooks.py)."""
        return f"{self.prefix}:bulkwebhooks"

    @property
    def bulk_webhook_log(self) -> str:
        """hash: bulk run id -> JSON {url, whk, body, attempts, state, last, at}: the message to send (a
        run's summary is fixed when it ends) and its deliveries; what `mlxq webhooks list` shows."""
        return f"{self.prefix}:bulkwebhooklog"

    # OpenAI's Files and Batch APIs (producer/openai_batch.py): each owner (API key) lists its own
    def file(self, file_id: str) -> str:  # hash: meta (JSON: OpenAI's file object, owner), content (the bytes)
        return f"{self.prefix}:file:{file_id}"

    def files(self, owner: str) -> str:  # zset: file id -> created (s), one owner's, for GET /v1/files
        return f"{self.prefix}:files:{owner}"

    def batches(self, owner: str) -> str:  # zset: batch id -> created (ms), one owner's, for GET /v1/batches
        return f"{self.prefix}:batches:{owner}"

    @property
    def batches_active(self) -> str:  # set: batch ids not yet ended: any gateway's driver may take one up
        return f"{self.prefix}:batches:active"

    def batch(self, batch_id: str) -> "BatchKeys":
        return BatchKeys(batch_id, self.prefix)

    @property
    def gateway_series(self) -> str:
        """stream: the dashboard's gateway series, one point per gateway every ``series_interval_s`` (API
        requests, 5xx answers, time to first streamed token p50/p95), trimmed to the hour (shared/series.py)."""
        return f"{self.prefix}:gateways:series"

    def model_keys(self, model: str) -> "ModelKeys":
        return ModelKeys(model, self.prefix)


class BatchKeys:
    """The keys of one OpenAI batch, under one hash tag: a line's result and its count are written in
    one transaction (MULTI on one slot of a cluster)."""

    def __init__(self, batch_id: str, prefix: str = "mlxq"):
        self._base = f"{prefix}:{{{prefix}:batch:{batch_id}}}"

    @property
    def meta(self) -> str:  # hash: the batch object's fields, each a JSON value
        return f"{self._base}:meta"

    @property
    def results(self) -> str:  # hash: input line number -> its output line (JSON), written once
        return f"{self._base}:results"

    @property
    def failed(self) -> str:  # hash: input line number -> 1, for the lines whose output is an error
        return f"{self._base}:failed"

    @property
    def jobs(self) -> str:  # hash: input line number -> "<model> <job id>" (a cancel finds the jobs)
        return f"{self._base}:jobs"

    @property
    def lease(self) -> str:  # string: the token of the gateway whose driver runs the batch (expires)
        return f"{self._base}:lease"


class ModelKeys:
    """The keys of one model's queue and of its jobs.  ``ModelKeys("*")``: glob patterns that match those
    keys of every model (the ACL recipe's, :mod:`mlxq.shared.acl`)."""

    def __init__(self, model: str, prefix: str = "mlxq"):
        if _BAD_MODEL_CHARS.search(model):
            raise ValueError(f"model name {model!r} may not contain braces or spaces")
        self.model = model
        self.prefix = prefix
        self.tag = f"{{{prefix}:{model}}}"
        self._base = f"{prefix}:{self.tag}"

    # queue-level
    @property
    def queue(self) -> str:  # zset: job id -> enqueue time + tier offset
        return f"{self._base}:queue"

    @property
    def inflight(self) -> str:  # zset: job id -> lease deadline
        return f"{self._base}:inflight"

    @property
    def dead(self) -> str:  # zset: job id (or garbage member) -> time moved aside
        return f"{self._base}:dead"

    @property
    def dead_info(self) -> str:  # hash: dead member -> why
        return f"{self._base}:deadinfo"

    @property
    def counts(self) -> str:  # hash: exact counters kept by the Lua scripts
        return f"{self._base}:counts"

    @property
    def wake(self) -> str:  # list: wake-up signal for idle workers
        return f"{self._base}:wake"

    @property
    def intake(self) -> str:  # list: ids enqueued by producers without write access to the queue
        return f"{self._base}:intake"

    @property
    def key_copy(self) -> str:  # hash: sha1(sha256(api key)) -> tier | revoked:<tier>; this slot's registry copy
        return f"{self._base}:apikeys"

    @property
    def policy(self) -> str:  # hash: offset:<tier>, max_queued, anonymous, version; this slot's policy copy
        return f"{self._base}:policy"

    @property
    def sched(self) -> str:
        """hash: job id -> "<tier> <score> <suspect 0|1>" of each job a worker admitted from the intake
        list, until it ends. Worker-only (no producer ACL rule names it): a requeue, the reaper and
        pull take a job's tier, score and suspect flag from here, never from the job hash, which a
        producer under the ACL recipe may write."""
        return f"{self._base}:sched"

    # fair shares between API keys within a tier (docs/PROTOCOL.md, "Fair shares"; _fair.lua)
    def fair_ring(self, tier: str) -> str:
        """zset: group (sha1(sha256(api key)), or "-" for jobs without a key) -> its turn, for each group
        with jobs queued at ``tier``; the lowest turn is served next (pick.lua)."""
        return f"{self._base}:fair:{tier}"

    @property
    def fair_jobs(self) -> str:
        """zset, every score 0: ``<tier>|<group>|<score %020.6f>|<job id>`` for each indexed queued job, so
        one group's oldest job at a tier is the first member of its lexical range (ZRANGEBYLEX)."""
        return f"{self._base}:fairq"

    @property
    def fair_state(self) -> str:
        """hash, worker-side: ``v:<tier>`` the turn last served, ``f:<tier>:<group>`` the turn a group
        that ran out of jobs would have had next, ``j:<job id>`` a job's member of ``fair_jobs``."""
        return f"{self._base}:fair"

    @property
    def usage(self) -> str:
        """hash: ``<day>|<group>|prompt``, ``...|completion``, ``...|jobs``: the tokens each API key's jobs
        used on this model, per UTC day (days since 1970-01-01, by the server's clock), for the last 92
        days (``day``: the last day counted); written by complete.lua, read by the quota check and
        ``mlxq usage``."""
        return f"{self._base}:usage"

    @property
    def fair_keys(self) -> list[str]:
        """The keys of fair shares and quotas that scripts declare, in their order: three rings, jobs,
        state, usage (_fair.lua's ``fk``)."""
        return [*(self.fair_ring(t) for t in TIERS), self.fair_jobs, self.fair_state, self.usage]

    @property
    def cancel_channel(self) -> str:  # pub/sub: ids of running jobs to cancel
        return f"{self._base}:cancel"

    @property
    def workers(self) -> str:  # zset: worker id -> last heartbeat
        return f"{self._base}:workers"

    @property
    def depth_exporter(self) -> str:
        """string: the token of the one process that exports this model's queue depth to Prometheus (a
        lease of ``EXPORTER_LEASE_S``, taken and renewed at scrape time; worker/metrics.py)."""
        return f"{self._base}:depth_exporter"

    @property
    def beats(self) -> str:
        """zset: worker id -> the server time until which its last heartbeat vouches for it (renew.lua
        sets it to now + that worker's ``takeover_after_s`` at every beat). Past it, any worker's
        reaper takes over the jobs the worker holds (reap.lua), without waiting for their leases."""
        return f"{self._base}:beats"

    @property
    def deferred(self) -> str:
        """zset: job id -> run_at (server epoch seconds) of a job that waits for its time (``run_at`` /
        ``defer_s``); status queued, in no queue yet. promote.lua, run before each pull, moves the due
        ones into the queue at the score their tier gave them at enqueue (run_at + the tier's offset)."""
        return f"{self._base}:deferred"

    @property
    def expiring(self) -> str:
        """zset: job id -> expires_at of each job submitted with one. The reaper's sweep (expire.lua)
        ends a job still queued (or deferred) past it as ``expired``; pull.lua checks the same time where
        it takes a job. A member whose job started or ended is dropped by the sweep."""
        return f"{self._base}:expiring"

    @property
    def webhooks(self) -> str:
        """zset: job id -> time submitted, of each job that named a ``webhook``: the webhook sender reads
        them, delivers once the job has ended, and removes them (producer/webhooks.py)."""
        return f"{self._base}:webhooks"

    @property
    def webhook_log(self) -> str:
        """hash: job id -> JSON of its delivery (url, attempts, last status or error, delivered_at), kept
        ``result_ttl_s``; what `mlxq webhooks list` shows."""
        return f"{self._base}:webhooklog"

    @property
    def series(self) -> str:
        """stream: the dashboard's rolling series, one point per worker every ``series_interval_s`` (its
        tokens, jobs ended, queue depth by tier, TTFT and queue wait quantiles), entries older than an
        hour trimmed at each append (shared/series.py)."""
        return f"{self._base}:series"

    def worker(self, worker_id: str) -> str:  # hash: one worker's stats (expires)
        return f"{self._base}:worker:{worker_id}"

    # job-level
    @property
    def job_prefix(self) -> str:
        return f"{self._base}:job:"

    def job(self, job_id: str) -> str:  # hash: request, status, result, lease owner
        return f"{self.job_prefix}{job_id}"

    def events(self, job_id: str) -> str:  # stream: the durable record of deltas
        return f"{self._base}:events:{job_id}"

    def channel(self, job_id: str) -> str:  # pub/sub: live deltas
        return f"{self._base}:chan:{job_id}"

    def done(self, job_id: str) -> str:  # list: one entry when the job ends (wakes result() waiters)
        return f"{self._base}:done:{job_id}"

    def idempotency(self, key: str, key_hash: str | None = None) -> str:
        """string: idempotency key -> job id, scoped to the API key that used it (``key_hash``: its
        sha256 hex, None for anonymous callers): ``B:idem:<sha1hex("idem:" + key_hash)>:<key>``. Two
        producers that pick the same key get two jobs, and neither can name the other's key: the
        scope comes from the API key itself, not from the registry copies' sha1(sha256(key)) names,
        which a producer under the ACL recipe may read. The enqueue and submit scripts check it."""
        scope = hashlib.sha1(("idem:" + (key_hash or "")).encode()).hexdigest()
        return f"{self.idempotency_prefix}{scope}:{key}"

    @property
    def idempotency_prefix(self) -> str:  # what every idempotency key of this queue begins with
        return f"{self._base}:idem:"
