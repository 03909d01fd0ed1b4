"""API keys decide a producer's tier; callers never choose it.  Keys are stored hashed.

Two modes, as vLLM, ollama and mlx-lm's server behave:
- open (no key registered yet): every caller, whatever key it sends (``api_key="EMPTY"``), is normal tier;
- keyed (once any key exists, revoked ones included): an unknown or revoked key is refused (401).
A caller that sends no key at all is normal tier in both modes.
"""

from __future__ import annotations

import hashlib
from typing import Optional

from .settings import TIERS

REVOKED = "revoked"
MIN_KEY_LENGTH = 8
KEY_RULES = (f"API keys: at least {MIN_KEY_LENGTH} characters (a random secret, e.g. `openssl rand -hex 16`); "
             "stored only as their sha256; tiers: " + ", ".join(TIERS) + ". While no key is registered, every "
             "caller is served at the normal tier (open mode); once any key exists, unknown and revoked keys "
             "are refused. A revoked key stays refused (its hash is kept).")


class AuthError(PermissionError):
    """An unknown or revoked API key (HTTP 401)."""


def key_hash(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def lower_tier(a: str, b: str) -> str:
    """The less urgent of two tiers (an endpoint floor can only lower a key's tier)."""
    return a if TIERS.index(a) >= TIERS.index(b) else b


def tier_from_record(record: Optional[bytes | str], api_key: Optional[str], keys_exist: bool = True) -> str:
    """The tier for a key's registry record; ``keys_exist=False`` (open mode): any key is normal."""
    if not api_key:
        return "normal"
    if record is None:
        if not keys_exist:
            return "normal"
        raise AuthError("unknown API key")
    value = record.decode() if isinstance(record, bytes) else record
    if value.startswith(REVOKED):
        raise AuthError("revoked API key")
    if value not in TIERS:
        raise AuthError("API key has no valid tier")
    return value


def resolve_tier(redis, registry_key: str, api_key: Optional[str], floor: Optional[str] = None) -> str:
    record = redis.hget(registry_key, key_hash(api_key)) if api_key else None
    keys_exist = record is not None or not api_key or bool(redis.exists(registry_key))
    tier = tier_from_record(record, api_key, keys_exist)
    return lower_tier(tier, floor) if floor else tier


def keys_registered(redis, registry_key: str) -> bool:
    """False while the gateway and clients run in open mode."""
    return bool(redis.exists(registry_key))


def add_key(redis, registry_key: str, api_key: str, tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}")
    if len(api_key) < MIN_KEY_LENGTH:
        raise ValueError(f"API keys must be at least {MIN_KEY_LENGTH} characters")
    redis.hset(registry_key, key_hash(api_key), tier)


def revoke_key(redis, registry_key: str, api_key: str) -> bool:
    h = key_hash(api_key)
    old = redis.hget(registry_key, h)
    if old is None:
        return False
    old = old.decode() if isinstance(old, bytes) else old
    redis.hset(registry_key, h, f"{REVOKED}:{old}")
    return True
