"""The one settings object of producers, workers and the engine, read from ``MLXQ_*`` environment variables.

Every option is a field of :class:`Settings` with its default; the field's metadata says, once, how
it is set: the environment variable ``MLXQ_<NAME>``, the ``mlxq worker`` and ``mlxq gateway`` flags
(generated from the fields by :func:`worker_flags` and :func:`gateway_flags`), the ``EngineConfig``
field it feeds (:meth:`Settings.engine_config`; the engine's defaults are that dataclass's) and its
help text.  ``Settings.from_env()`` is the one reader; ``__post_init__`` refuses bad values with a
message that names the variable and the flag.  :func:`cache_dir` is the one place the cache
directory's default lives.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlsplit, urlunsplit

from .engine_config import BLOCK_SIZE, DEFAULT_CHUNK_SCHEDULE, DEFAULT_KV_MEMORY_MB, SPECULATE_MODES, EngineConfig

TIERS = ("high", "normal", "low")
_ENGINE = EngineConfig()  # the engine fields' defaults
DEFAULT_TIER_OFFSETS = {"high": 0.0, "normal": 30.0, "low": 300.0}
ATTENTION_MODES = ("auto", "fused", "gather")
MATMUL_MODES = ("auto", "pool", "mlx")
CPU_WEIGHTS = ("fp32", "quantized", "int8-dot")  # a quantized model on the CPU: dequantized at load, or read as stored
MAX_IDLE_BLOCK_S = 10.0  # connections read with a 20 s timeout (shared/connection.py)
# MLXQ_* variables read elsewhere (the BLAS set-up and the extension, before MLX loads; the cache
# directory; the test kit's model seed): any other MLXQ_* name that is not a setting is reported as
# unknown (a misspelt setting)
OTHER_ENV = frozenset({"MLXQ_CACHE_DIR",
                       "MLXQ_BLAS", "MLXQ_BLAS_LIB", "MLXQ_BLAS_THREADS", "MLXQ_ATTN_ISA", "MLXQ_ATTN_THREADS",
                       "MLXQ_POOL_SPIN_US", "MLXQ_TEST_MODEL_SEED",
                       "MLXQ_TIMEOUT_S"})  # (the last: examples/node/producer.mjs reads it)
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where built things are cached (the test and bench models, the attention extension, the BLAS
    shim): ``$MLXQ_CACHE_DIR``, else ``~/.cache/mlxq``."""
    return Path(os.environ.get("MLXQ_CACHE_DIR") or Path.home() / ".cache" / "mlxq")


# ---------------------------------------------------------------- parsing one value (env var or flag)
def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected on/off (1/0, true/false, yes/no), got {text!r}")


def _parse_offsets(text: str) -> dict[str, float]:
    offsets = dict(DEFAULT_TIER_OFFSETS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in TIERS or not value:
            raise ValueError(f"expected tier=seconds with tier in {TIERS}, got {part!r}")
        offsets[name] = _float(value)
    return offsets


def _parse_chunks(text: str) -> tuple:
    """``2048:512,8192:256,*:64``: below position 2048 chunks of 512 tokens, ..., then 64."""
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        limit, sep, size = part.partition(":")
        if not sep:
            raise ValueError(f"expected position:chunk pairs (e.g. 2048:512,*:64), got {part!r}")
        pairs.append((None if limit.strip() == "*" else _int(limit), _int(size)))
    return tuple(pairs)


def _show_chunks(schedule) -> str:
    return ",".join(f"{'*' if limit is None else limit}:{size}" for limit, size in schedule)


def _show_offsets(offsets: dict) -> str:
    return ",".join(f"{k}={v:g}" for k, v in offsets.items())


def _mib_to_bytes(mib: Optional[float]) -> Optional[int]:
    return None if mib is None else int(mib * 2**20)


def mask_url(url: Optional[str]) -> Optional[str]:
    """A Redis URL fit for a log: its password replaced by ``***``."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


_PARSERS: dict[str, Callable[[str], object]] = {
    "int": _int, "Optional[int]": _int, "float": _float, "Optional[float]": _float,
    "bool": _bool, "str": str, "Optional[str]": str,
}


def opt(default=None, help: str = "", *, factory=None, flag: Optional[str] = None, worker: bool = True,
        gateway: bool = False, engine: Optional[str] = None, to_engine: Optional[Callable] = None, choices: Optional[tuple] = None,
        parse: Optional[Callable] = None, show: Optional[Callable] = None, shown_default: Optional[str] = None,
        secret: bool = False):
    """A settings field and how it is set.  ``worker``: ``mlxq worker`` has a flag for it (``flag``,
    else ``--name-with-dashes``); ``gateway``: ``mlxq gateway`` has that flag; ``engine``: the ``EngineConfig`` field it feeds (through
    ``to_engine``); ``shown_default``: the default as said in ``--help``, where the value is None;
    ``secret``: never shown (``***`` in :meth:`Settings.describe`)."""
    meta = dict(help=help, flag=flag, worker=worker, gateway=gateway, engine=engine, to_engine=to_engine, choices=choices,
                parse=parse, show=show, shown_default=shown_default, secret=secret)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def engine_opt(param: str, help: str, **kw):
    """A setting that feeds ``EngineConfig``'s field ``param``, with that field's default (the KV
    budget, the one field converted on the way, defaults to None in either unit: the engine decides)."""
    return opt(getattr(_ENGINE, param), help, engine=param, **kw)


@dataclass(slots=True)
class Settings:
    """One place for every knob. ``Settings.from_env()`` reads ``MLXQ_<NAME>``; ``mlxq worker`` has a flag
    for each worker and engine field."""

    # -- Redis and the queue protocol (producers and workers) --------------------------------------------------
    redis_url: Optional[str] = opt(None, "Redis URL", worker=False)  # --redis-url: an option of every command
    prefix: str = opt("mlxq", "the key prefix of every Redis key", gateway=True)
    tier_offsets: dict[str, float] = opt(
        help="seconds added to a job's queue score per tier (tier=seconds,...; an admin's `mlxq tiers` wins)",
        factory=lambda: dict(DEFAULT_TIER_OFFSETS), parse=_parse_offsets, show=_show_offsets)
    max_queued_per_tier: int = opt(10_000, "past this, submit fails with an overload error")
    lease_s: float = opt(30.0, "a pulled job's lease in seconds; the heartbeat renews it")
    heartbeat_s: float = opt(2.0, "seconds between lease renewals (shorter than the lease)")
    takeover_s: Optional[float] = opt(
        None, "a worker whose last heartbeat is this many seconds old is judged dead: any live worker's reaper "
        "requeues its jobs then, fenced (its late writes are refused), without waiting for their leases",
        shown_default="2.5 x heartbeat_s")
    stall_s: float = opt(120.0, "a worker whose engine completes no step this many seconds while it runs jobs is "
                         "stuck: it renews nothing more, logs why and exits (code 70) for its supervisor to "
                         "restart it; other workers take its jobs over")
    max_attempts: int = opt(3, "leases that may expire before a job goes to the dead-letter set")
    result_ttl_s: int = opt(24 * 3600, "seconds results and token streams are kept")
    gather_ms: float = opt(5.0, "an idle worker, once woken, waits this long to gather a batch")
    idle_block_s: float = opt(1.0, "longest block on the wake-up signal, in seconds")
    stats_interval_s: float = opt(1.0, "seconds between worker stats snapshots")
    series_interval_s: float = opt(10.0, "seconds between a worker's (or gateway's) points of the dashboard's "
                                   "rolling series (kept an hour)", gateway=True)
    idempotency_ttl_s: int = opt(24 * 3600, "seconds an idempotency key is remembered", worker=False,
                                gateway=True)
    max_prompt_bytes: int = opt(4 * 1024 * 1024, "a hard cap on request size at submit", worker=False,
                                  gateway=True)
    max_file_bytes: int = opt(64 * 1024 * 1024, "the gateway's cap on an uploaded file (POST /v1/files): it "
                              "bounds the memory (or, with files_dir, the disk) one upload takes", worker=False,
                              gateway=True)
    files_dir: Optional[str] = opt(None, "a directory for the bytes of the Batch API's files (uploads, output and "
                                   "error files), each named by its file id; every gateway of a deployment must "
                                   "see the same one (a shared volume)", worker=False, gateway=True,
                                   shown_default="none: in Redis")
    batch_window: int = opt(256, "the lines of one OpenAI batch (POST /v1/batches) queued at a time", worker=False,
                            gateway=True)
    completion_windows: str = opt("24h", "the completion_window values POST /v1/batches takes, comma-separated, "
                                  "each a whole number of s, m, h or d (OpenAI takes 24h); a batch not ended "
                                  "within its window ends expired", worker=False, gateway=True)
    max_new_tokens: int = opt(32_768, "the most tokens one job may ask for")
    live_worker_s: float = opt(10.0, "a model's worker counts as live while its last heartbeat is this recent",
                               worker=False, gateway=True)
    no_worker_wait_s: float = opt(3.0, "how long a request for a model with no live worker waits for one before "
                                  "a 503 with Retry-After; /v1/batch/ requests are queued anyway", worker=False,
                                  gateway=True)
    sse_keepalive_s: float = opt(15.0, "while a streamed request waits in the queue for its first token, the "
                                 "gateway sends an SSE comment (`: keep-alive`) this often, so that a proxy's "
                                 "idle timeout does not cut it", worker=False, gateway=True)
    ready_timeout_s: float = opt(2.0, "the gateway's /ready answers 503 when Redis does not answer within this",
                                 worker=False, gateway=True)
    # one setting for every process (worker, gateway, CLI): a shared option of every command (mlxq/cli/options.py)
    log_format: str = opt("text", "log lines as text, or one JSON object per line (json) with job and attempt "
                          "fields", worker=False, choices=("text", "json"))
    log_level: str = opt("INFO", "the lowest level logged: DEBUG, INFO, WARNING or ERROR", worker=False)
    redis_outage_s: float = opt(30.0, "producers retry an unreachable Redis this long, a job's result() or stream() "
                                "with no timeout included (then: ConnectionError, HTTP 503)", worker=False,
                                gateway=True)
    submit_replica_ack_ms: int = opt(0, "submit returns once one replica has the job (WAIT 1 <ms>), or after this "
                                     "many ms with a warning; 0: off (a failover may lose a job just submitted, "
                                     "which its producer then submits again)", worker=False,
                                     gateway=True)
    # completion webhooks (docs/pipelines/job-life.md): only hosts an operator allowed are ever called
    webhook_hosts: Optional[str] = opt(None, "hosts a job's webhook URL may name (comma-separated, e.g. "
                                       "hooks.example.com,ci.example.com); a URL for any other is refused at "
                                       "submit and again at send", worker=False, gateway=True,
                                       shown_default="none: webhooks are refused")
    webhook_private: bool = opt(False, "let an allowed webhook host resolve to a loopback, private, link-local "
                                "or reserved address (off: refused, so a caller cannot make the server probe its "
                                "own network)", worker=False, gateway=True)
    webhook_max_attempts: int = opt(8, "deliveries of one webhook tried before it is recorded as failed "
                                    "(backoff with jitter between them)", worker=False)

    # -- a producer's own: the CLI's producer commands, a Client's default queue, the rq bridge called directly -
    model: Optional[str] = opt(None, "the queue a producer submits to when it names none (a served model's name)",
                               worker=False, shown_default="the only model served")
    # the caller's credential (its jobs' tier); a secret: masked wherever settings are shown
    api_key: Optional[str] = opt(None, "an mlxq API key: the CLI's producer and operator commands, and the rq "
                                 "bridge called directly, use it", worker=False, secret=True)

    # -- the worker process -----------------------------------------------------------------------------------
    keep_dtype: bool = opt(False, "keep quantized/bf16 weights (on the CPU they are converted to fp32 by default)")
    cpu_weights: str = opt("fp32", "on the CPU, a quantized model's weights: fp32 (dequantized at load: 4 bytes a "
                           "weight) or quantized (4/8-bit blocks kept packed and read as stored: ~6/10 bits a weight, "
                           "fewer bytes read a decode step; where the CPU has AVX2+FMA the same results as fp32), or int8-dot "
                           "(the same packed blocks, dot products in 8-bit integers on activations rounded to 8 bits "
                           "per 32, as llama.cpp: fastest at a few rows; logits differ from fp32 by the rounding, a "
                           "row's still the same in any batch). Fixed per worker; keep_dtype overrides it", choices=CPU_WEIGHTS)
    embed_pooling: str = opt("auto", "how an embedding job's hidden states are pooled when the job does not say: "
                             "last (the last token's: decoder embedders such as Qwen3-Embedding), mean, or auto "
                             "(the model directory's sentence-transformers 1_Pooling/config.json, else last)",
                             choices=("auto", "last", "mean"))
    grace_s: float = opt(30.0, "warm-shutdown grace period in seconds", flag="--grace")
    burst: bool = opt(False, "exit when the queue is empty")
    host_thread: bool = opt(True, "detokenize and publish each step's tokens on a thread of their own while "
                            "MLX runs the next step (off: on the MLX thread, between steps)")
    rq_queues: Optional[str] = opt(None, "also take jobs from these rq queues (comma-separated, e.g. "
                                   "mlxq-high,mlxq-normal,mlxq-low; see mlxq.producer.rq_bridge)", shown_default="none")
    # the rq bridge's own API key (its jobs' tier); a secret: no flag (a command line is visible to every
    # user of the host), masked in the start-up log
    rq_api_key: Optional[str] = opt(None, "the rq bridge's API key", worker=False, secret=True)
    metrics_port: Optional[int] = opt(None, "serve Prometheus metrics on this port",
                                      shown_default="no metrics server")
    metrics_host: str = opt("127.0.0.1", "the address the metrics server binds: loopback; 0.0.0.0 exposes it "
                            "on every interface (for a Prometheus on another host)")

    # -- the engine: EngineConfig's fields, with its defaults ---------------------------------------------------------
    max_batch: Optional[int] = engine_opt("max_batch", "most sequences decoded together",
                                          shown_default="as many as the KV memory holds")
    kv_memory_mb: Optional[float] = engine_opt("memory_budget_bytes", "KV block pool budget in MiB",
                                               to_engine=_mib_to_bytes,
                                               shown_default=f"{DEFAULT_KV_MEMORY_MB}, never more than max "
                                               "sequences x context")
    kv_blocks: Optional[int] = engine_opt("num_blocks", "a fixed number of 32-token KV blocks",
                                          shown_default="as many as --kv-memory-mb holds")
    block_size: int = engine_opt("block_size", "tokens per KV block (only 32 is supported)")
    pressure: float = engine_opt("pressure", "admit while used KV blocks stay under this share of the pool")
    prefix_cache: bool = engine_opt("prefix_cache", "reuse the KV blocks of shared prompt prefixes")
    chunked_prefill: bool = engine_opt("chunked_prefill", "prefill long prompts in chunks between decode steps")
    chunk_schedule: tuple = engine_opt("chunk_schedule", "prefill chunk size by prompt position "
                                       "(position:tokens,...; * for every later position)",
                                       parse=_parse_chunks, show=_show_chunks)
    step_token_budget: int = engine_opt("step_token_budget", "tokens of one engine step (prefill chunks + decode rows)")
    decode_reserve_blocks: int = engine_opt("decode_reserve_blocks", "KV blocks admission keeps free for the running "
                                            "sequences' next tokens")
    priority_gap: float = engine_opt("priority_gap", "how much more urgent a job must be to preempt another")
    max_sequences: int = engine_opt("max_sequences", "most sequences the engine holds at once (running and waiting)")
    max_waiting: int = engine_opt("max_waiting", "most jobs waiting inside the engine for KV memory")
    session_dir: Optional[str] = engine_opt("session_dir", "where session KV is written under pressure and at shutdown",
                                            shown_default="not written")
    attention: str = engine_opt("attention", "auto (the fused CPU op when it builds, else gather), fused, or gather",
                                choices=ATTENTION_MODES)
    matmul: str = engine_opt("matmul", "weight matmuls: auto (pool where the CPU runs the extension's own loops: "
                             "x86-64 with AVX2+FMA, float32 weights on the CPU; else mlx), pool (those loops on the "
                             "extension's threads, faster; a row's bits do not depend on its batch, "
                             "so batched greedy answers equal solo ones exactly; they differ from MLX's matmul in the "
                             "last bits, so a long greedy answer can part from mlx-lm's at a near-tie), or mlx "
                             "(MLX's own matmul, bit for bit mlx-lm's alone; in a batch a row's bits can change)",
                             choices=MATMUL_MODES)
    kv_bits: Optional[int] = engine_opt("kv_bits", "store KV blocks quantized, 8 or 4 bits (more sequences per MiB)",
                                        shown_default="none: the model's float dtype")
    kv_group_size: int = engine_opt("kv_group_size", "elements per scale/bias group of quantized KV blocks "
                                    "(32, 64 or 128)")
    huge_pages: bool = engine_opt("huge_pages", "back the model's weights and the KV pool with 2 MiB pages where "
                                  "Linux allows (madvise at start: faster decode steps, docs/design/engine.md)")
    speculate: str = engine_opt("speculate", "speculative decoding: auto (ngram where the weight matmuls are the "
                                "extension's own loops, whose rows do not depend on the batch: --matmul pool or auto on "
                                "x86-64 with AVX2+FMA; else off), off, ngram (prompt lookup: what followed the "
                                "context's last tokens earlier in it is proposed and verified in the batch) or draft "
                                "(a smaller model with the same tokenizer proposes: --draft-model); the output is the "
                                "same token for token (with --matmul mlx, as batching there, a long greedy answer can "
                                "part at a near-tie), and a step speculates only where measured step times say it "
                                "pays (docs/design/speculative.md)", choices=SPECULATE_MODES)
    speculate_k: int = engine_opt("speculate_k", "most tokens one proposal holds (each sequence's own k adapts "
                                  "below it)")
    draft_model: Optional[str] = engine_opt("draft_model", "the draft model of --speculate draft (refused with any "
                                            "other --speculate): a directory, GGUF file or hub id, with the model's "
                                            "tokenizer", shown_default="none")

    def __post_init__(self) -> None:
        unknown = set(self.tier_offsets) - set(TIERS)
        if unknown:
            raise ValueError(f"unknown tiers in tier_offsets: {sorted(unknown)}")
        for name, ok, rule in self._rules():
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} ({where(name)}): {rule}")

    def _rules(self):
        """(field, holds, what it must be): checked in order, the first broken one is reported."""
        pos = "must be positive"
        yield from (
            ("max_queued_per_tier", self.max_queued_per_tier >= 1, pos),
            ("lease_s", self.lease_s > 0, pos),
            ("max_attempts", self.max_attempts >= 1, pos),
            ("heartbeat_s", self.heartbeat_s > 0, pos),
            ("heartbeat_s", self.heartbeat_s < self.lease_s, "heartbeat_s must be shorter than lease_s"),
            ("takeover_s", self.takeover_s is None or (math.isfinite(self.takeover_s)
                                                       and self.takeover_s > self.heartbeat_s),
             "must be longer than heartbeat_s (a live worker beats within it)"),
            ("stall_s", self.stall_s > 0 and math.isfinite(self.stall_s), "must be a positive number of seconds"),
            ("tier_offsets", all(math.isfinite(v) for v in self.tier_offsets.values()),
             "offsets must be finite numbers"),
            ("result_ttl_s", self.result_ttl_s >= 1, "must be at least 1 (seconds results and streams are kept)"),
            ("idempotency_ttl_s", self.idempotency_ttl_s >= 1, "must be at least 1"),
            ("max_file_bytes", self.max_file_bytes >= 1, "must be at least 1"),
            ("files_dir", self.files_dir is None or os.path.isdir(self.files_dir), "must be an existing directory"),
            ("batch_window", self.batch_window >= 1, "must be at least 1"),
            ("completion_windows", _valid_windows(self.completion_windows),
             "must be comma-separated durations such as 24h, 30m or 90s"),
            ("submit_replica_ack_ms", self.submit_replica_ack_ms >= 0, "must not be negative (0: off)"),
            ("webhook_max_attempts", self.webhook_max_attempts >= 1, pos),
            ("idle_block_s", 0 < self.idle_block_s <= MAX_IDLE_BLOCK_S,
             f"must be above 0 and at most {MAX_IDLE_BLOCK_S:g} (a blocking pull returns well inside the "
             "connection's read timeout)"),
            ("stats_interval_s", self.stats_interval_s > 0, pos),
            ("series_interval_s", self.series_interval_s > 0, pos),
            ("sse_keepalive_s", self.sse_keepalive_s > 0 and math.isfinite(self.sse_keepalive_s), pos),
            ("ready_timeout_s", self.ready_timeout_s > 0 and math.isfinite(self.ready_timeout_s), pos),
            ("log_format", self.log_format in ("text", "json"), "must be text or json"),
            ("prefix", "{" not in self.prefix and "}" not in self.prefix,
             "prefix must not contain braces (they delimit Redis Cluster hash tags)"),
            ("max_new_tokens", self.max_new_tokens >= 1, pos),
            ("gather_ms", self.gather_ms >= 0, "must not be negative"),
            ("grace_s", self.grace_s >= 0, "must not be negative"),
            ("metrics_port", self.metrics_port is None or 1 <= self.metrics_port <= 65535,
             "must be a port number, 1 to 65535"),
            ("max_batch", self.max_batch is None or self.max_batch >= 1, "must be at least 1"),
            ("kv_memory_mb", self.kv_memory_mb is None or self.kv_memory_mb > 0, pos),
            ("kv_blocks", self.kv_blocks is None or self.kv_blocks >= 2, "must be at least 2"),
            ("block_size", self.block_size == BLOCK_SIZE,
             f"only {BLOCK_SIZE}-token blocks are supported (the attention kernels and session files use them)"),
            ("pressure", 0 < self.pressure <= 1, "must be a share of the pool, above 0 and at most 1"),
            ("chunk_schedule", _valid_chunks(self.chunk_schedule),
             "must be position:tokens pairs with increasing positions and positive sizes, * only last"),
            ("step_token_budget", self.step_token_budget >= 1, pos),
            ("decode_reserve_blocks", self.decode_reserve_blocks >= 0, "must not be negative"),
            ("priority_gap", self.priority_gap >= 0, "must not be negative"),
            ("max_sequences", self.max_sequences >= 1, pos),
            ("max_waiting", self.max_waiting >= 0, "must not be negative"),
            ("attention", self.attention in ATTENTION_MODES, f"must be one of {', '.join(ATTENTION_MODES)}"),
            ("matmul", self.matmul in MATMUL_MODES, f"must be one of {', '.join(MATMUL_MODES)}"),
            ("cpu_weights", self.cpu_weights in CPU_WEIGHTS, f"must be one of {', '.join(CPU_WEIGHTS)}"),
            ("kv_bits", self.kv_bits in (None, 4, 8), "only 4 or 8 bit KV blocks are supported"),
            ("kv_group_size", self.kv_group_size in (32, 64, 128), "must be 32, 64 or 128"),
            ("speculate", self.speculate in SPECULATE_MODES, f"must be one of {', '.join(SPECULATE_MODES)}"),
            ("speculate_k", self.speculate_k >= 1, "must be at least 1"),
            ("speculate", self.speculate != "draft" or self.draft_model is not None,
             "draft needs a draft model (--draft-model PATH)"),
            ("draft_model", self.draft_model is None or self.speculate == "draft",
             f"is read by --speculate draft only (here: {self.speculate})"),
        )

    @property
    def takeover_after_s(self) -> float:
        """How long a worker's heartbeat vouches for it: ``takeover_s``, else two and a half heartbeats
        (a worker that missed two beats in a row is dead, or too stalled to serve its jobs)."""
        return self.takeover_s if self.takeover_s is not None else 2.5 * self.heartbeat_s

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> "Settings":
        """Settings from ``MLXQ_<NAME>`` variables; ``overrides`` (e.g. command-line values) win where not None."""
        env = os.environ if env is None else env
        unknown = sorted(k for k in env if k.startswith("MLXQ_") and k not in OTHER_ENV
                         and k[len("MLXQ_"):].lower() not in _FIELD_NAMES)
        if unknown:
            log.warning("unknown MLXQ_ variables ignored: %s (the settings' variables are in "
                        "`mlxq worker --help` and docs/reference/settings.md)", ", ".join(unknown))
        values: dict = {}
        for f in fields(cls):
            raw = env.get(env_var(f.name))
            if raw is None or raw == "":
                continue
            try:
                values[f.name] = parser(f.name)(raw)
            except ValueError as exc:
                raise ValueError(f"{env_var(f.name)}={raw!r}: {exc}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def read(cls, name: str, env: dict[str, str] | None = None):
        """One setting from ``MLXQ_<NAME>`` (its default when unset), without building or checking the
        others: the CLI's shared options take their defaults before logging is set up, and the
        command's own settings report unknown variables once."""
        raw = (os.environ if env is None else env).get(env_var(name))
        if raw is None or raw == "":
            f = _FIELDS[name]
            return f.default if f.default_factory is MISSING else f.default_factory()
        try:
            return parser(name)(raw)
        except ValueError as exc:
            raise ValueError(f"{env_var(name)}={raw!r}: {exc}") from None

    def engine_config(self) -> EngineConfig:
        """The engine's configuration these settings make (what comes from the model is not in it)."""
        out = {}
        for f in fields(self):
            param, convert = f.metadata["engine"], f.metadata["to_engine"]
            if param:
                value = getattr(self, f.name)
                out[param] = convert(value) if convert else value
        return EngineConfig(**out)

    def describe(self) -> str:
        """Every setting on one line, for the worker's start-up log (the Redis password masked)."""
        return " ".join(f"{f.name}={self._shown(f)}" for f in fields(self))

    def _shown(self, f) -> str:
        value = getattr(self, f.name)
        if f.metadata["secret"] and value is not None:
            return "***"
        if f.name == "redis_url":
            value = mask_url(value)
        show = f.metadata.get("show")
        return show(value) if show and value is not None else str(value)


_FIELD_NAMES = frozenset(f.name for f in fields(Settings))


_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def completion_windows(text: str) -> dict[str, int]:
    """The windows of ``completion_windows``: each as written ("24h") -> its seconds; ValueError for one
    that is not a whole positive number of s, m, h or d."""
    out = {}
    for w in (x.strip() for x in text.split(",")):
        if len(w) < 2 or w[-1] not in _UNIT_S or not w[:-1].isdigit() or int(w[:-1]) < 1:
            raise ValueError(f"completion window {w!r} is not a whole positive number of s, m, h or d")
        out[w] = int(w[:-1]) * _UNIT_S[w[-1]]
    return out


def _valid_windows(text) -> bool:
    try:
        return bool(completion_windows(text))
    except (ValueError, AttributeError):
        return False


def _valid_chunks(schedule) -> bool:
    try:
        limits = [limit for limit, _ in schedule]
        sizes = [size for _, size in schedule]
    except (TypeError, ValueError):
        return False
    bounded = [x for x in limits if x is not None]
    return (bool(schedule) and all(isinstance(s, int) and s >= 1 for s in sizes)
            and None not in limits[:-1] and bounded == sorted(set(bounded)) and all(x >= 1 for x in bounded))


_FIELDS = {f.name: f for f in fields(Settings)}


def env_var(name: str) -> str:
    return f"MLXQ_{name.upper()}"


def flag(name: str) -> Optional[str]:
    """The ``mlxq worker`` or ``mlxq gateway`` flag of a field (None: neither has one)."""
    meta = _FIELDS[name].metadata
    if name == "redis_url":
        return "--redis-url"
    if name in ("log_format", "log_level"):
        return "--" + name.replace("_", "-")  # a shared option of every command
    if not (meta["worker"] or meta["gateway"]):
        return None
    return meta["flag"] or "--" + name.replace("_", "-")


def where(name: str) -> str:
    """How a field is set, for error messages: ``MLXQ_MAX_BATCH / --max-batch``."""
    return " / ".join(x for x in (env_var(name), flag(name)) if x)


def parser(name: str) -> Callable[[str], object]:
    f = _FIELDS[name]
    return f.metadata["parse"] or _PARSERS[f.type]


@dataclass(frozen=True)
class Flag:
    """One generated ``mlxq worker`` or ``mlxq gateway`` flag."""

    name: str  # the field (and the argparse dest)
    flag: str
    help: str
    is_bool: bool
    parse: Callable[[str], object]
    choices: Optional[tuple]


def worker_flags() -> list[Flag]:
    """The ``mlxq worker`` flags, one per worker and engine field, with help that gives the default and the
    environment variable."""
    return flags(f.name for f in fields(Settings) if f.metadata["worker"] and f.name not in ("redis_url", "log_format"))


def gateway_flags() -> list[Flag]:
    """The ``mlxq gateway`` flags, one per field marked ``gateway``, as :func:`worker_flags`."""
    return flags(f.name for f in fields(Settings) if f.metadata["gateway"])


def flags(names) -> list[Flag]:
    """The flags of these fields (``mlxq worker``'s, ``mlxq gateway``'s): ``--name-with-dashes`` unless the
    field names its own, with help that gives the default and the environment variable."""
    out = []
    for name in names:
        f = _FIELDS[name]
        meta = f.metadata
        default = f.default if f.default_factory is MISSING else f.default_factory()
        shown = meta["shown_default"] or (meta["show"](default) if meta["show"] else _on_off(default))
        text = f"{meta['help']}; env ${env_var(f.name)} (default: {shown})"
        fl = meta["flag"] or "--" + name.replace("_", "-")
        out.append(Flag(f.name, fl, text, f.type == "bool", parser(f.name), meta["choices"]))
    return out


def _on_off(value) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)

