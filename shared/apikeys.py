"""API keys decide a producer's tier; callers never choose it.  Keys are stored hashed."""

from __future__ import annotations

import hashlib
from typing import Optional

from .settings import TIERS

REVOKED = "revoked"


class AuthError(PermissionError):
    """An unknown or revoked API key (HTTP 401)."""


def key_hash(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def lower_tier(a: str, b: str) -> str:
    """The less urgent of two tiers (an endpoint floor can only lower a key's tier)."""
    return a if TIERS.index(a) >= TIERS.index(b) else b


def tier_from_record(record: Optional[bytes | str], api_key: Optional[str]) -> str:
    if api_key is None:
        return "normal"
    if record is None:
        raise AuthError("unknown API key")
    value = record.decode() if isinstance(record, bytes) else record
    if value.startswith(REVOKED):
        raise AuthError("revoked API key")
    if value not in TIERS:
        raise AuthError("API key has no valid tier")
    return value


def resolve_tier(redis, registry_key: str, api_key: Optional[str], floor: Optional[str] = None) -> str:
    tier = tier_from_record(redis.hget(registry_key, key_hash(api_key)) if api_key is not None else None, api_key)
    return lower_tier(tier, floor) if floor else tier


def add_key(redis, registry_key: str, api_key: str, tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}")
    if len(api_key) < 8:
        raise ValueError("API keys must be at least 8 characters")
    redis.hset(registry_key, key_hash(api_key), tier)


def revoke_key(redis, registry_key: str, api_key: str) -> bool:
    h = key_hash(api_key)
    old = redis.hget(registry_key, h)
    if old is None:
        return False
    old = old.decode() if isinstance(old, bytes) else old
    redis.hset(registry_key, h, f"{REVOKED}:{old}")
    return True
