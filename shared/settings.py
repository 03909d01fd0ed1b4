"""Settings shared by producers and workers, read from ``MLXQ_*`` environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

TIERS = ("high", "normal", "low")
DEFAULT_TIER_OFFSETS = {"high": 0.0, "normal": 30.0, "low": 300.0}


def _parse_offsets(text: str) -> dict[str, float]:
    offsets = dict(DEFAULT_TIER_OFFSETS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in TIERS or not value:
            raise ValueError(f"MLXQ_TIER_OFFSETS: expected tier=seconds with tier in {TIERS}, got {part!r}")
        offsets[name] = float(value)
    return offsets


@dataclass(slots=True)
class Settings:
    """One place for every knob. ``Settings.from_env()`` reads ``MLXQ_<NAME>``."""

    redis_url: str | None = None
    prefix: str = "mlxq"
    tier_offsets: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_OFFSETS))
    max_queued_per_tier: int = 10_000  # past this, submit fails with an overload error
    lease_s: float = 30.0  # a pulled job's lease; the heartbeat renews it
    heartbeat_s: float = 2.0
    max_attempts: int = 3  # leases that may expire before a job goes to the dead-letter set
    result_ttl_s: int = 24 * 3600  # how long results and token streams are kept
    gather_ms: float = 5.0  # an idle worker, once woken, waits this long to gather a batch
    idle_block_s: float = 1.0  # longest block on the wake-up signal
    stats_interval_s: float = 1.0
    idempotency_ttl_s: int = 24 * 3600
    max_prompt_bytes: int = 4 * 1024 * 1024  # a hard cap on request size at submit
    max_new_tokens: int = 32_768
    live_worker_s: float = 10.0  # a model's worker counts as live while its last heartbeat is this recent
    no_worker_wait_s: float = 3.0  # the gateway waits this long for a live worker, then answers 503
    redis_outage_s: float = 30.0  # producers retry an unreachable Redis this long (then: ConnectionError, HTTP 503)

    def __post_init__(self) -> None:
        unknown = set(self.tier_offsets) - set(TIERS)
        if unknown:
            raise ValueError(f"unknown tiers in tier_offsets: {sorted(unknown)}")
        if self.max_queued_per_tier < 1 or self.lease_s <= 0 or self.max_attempts < 1:
            raise ValueError("max_queued_per_tier, lease_s and max_attempts must be positive")
        if self.heartbeat_s >= self.lease_s:
            raise ValueError("heartbeat_s must be shorter than lease_s")
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError("prefix must not contain braces (they delimit Redis Cluster hash tags)")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> "Settings":
        env = os.environ if env is None else env
        values: dict = {}
        for f in fields(cls):
            raw = env.get(f"MLXQ_{f.name.upper()}")
            if raw is None or raw == "":
                continue
            if f.name == "tier_offsets":
                values[f.name] = _parse_offsets(raw)
            elif f.type in ("int", int):
                values[f.name] = int(raw)
            elif f.type in ("float", float):
                values[f.name] = float(raw)
            else:
                values[f.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
