"""API keys decide a producer's tier; callers never choose it.  Keys are stored hashed.

Two modes, as vLLM, ollama and mlx-lm's server behave:
- open (no key registered yet): every caller, whatever key it sends (``api_key="EMPTY"``), is normal tier;
- keyed (once any key exists, revoked ones included): an unknown or revoked key is refused (401), and so
  is a caller that sends no key at all, unless the admin opted in to anonymous callers
  (``mlxq tiers --anonymous normal|low``; the policy's ``anonymous`` field; ``refuse`` refuses them even
  in open mode).

Each key also has a name and an admin flag (``mlxq:apikeys:info``: sha256(key) -> JSON), which
``mlxq keys list`` shows in place of the key or its hash.

The global registry (``mlxq:apikeys``: sha256(key) -> tier) is the admin's record.  The
enqueue script decides the tier inside Redis, from a copy kept in each model's hash slot
(``{mlxq:<model>}:apikeys``: sha1(sha256(key)) -> tier, so reading the copy reveals no
usable credential) and from the policy (tier offsets, queue bound) also copied there.

Keeping the copies in sync:
* ``add_key``/``revoke_key``/``set_policy`` write the global record, bump
  ``mlxq:policy:version``, then write every registered model's copy at once;
* every worker compares its model's copy version with the global one on each
  stats tick (about a second) and re-copies everything when they differ, which
  covers a model registered during an admin change and a brand-new model.
So a revocation holds within one stats tick at worst.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Optional

from .codec import text as _s
from .keys import GlobalKeys
from .settings import DEFAULT_TIER_OFFSETS, TIERS
from .steps import run_steps

REVOKED = "revoked"
MIN_KEY_LENGTH = 8
# the policy's ``anonymous``: the tier of callers that send no key; unset, they are served at the normal
# tier while no key is registered and refused once one is
ANONYMOUS_CHOICES = ("normal", "low", "refuse")
KEY_REQUIRED = ("an API key is required (keys are registered; `mlxq tiers --anonymous normal` serves callers "
                "without one)")
KEY_RULES = (f"API keys: at least {MIN_KEY_LENGTH} characters (`mlxq keys create` makes one); stored only as "
             "their sha256; tiers: " + ", ".join(TIERS) + ". While no key is registered, every caller is served "
             "at the normal tier (open mode); once any key exists, unknown and revoked keys are refused, and so "
             "are callers without a key unless `mlxq tiers --anonymous normal|low` lets them in. A revoked key "
             "stays refused (its hash is kept).")


class AuthError(PermissionError):
    """An unknown or revoked API key (HTTP 401)."""


def key_hash(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def lower_tier(a: str, b: str) -> str:
    """The less urgent of two tiers (an endpoint floor can only lower a key's tier)."""
    return a if TIERS.index(a) >= TIERS.index(b) else b


def tier_from_record(record: Optional[bytes | str], api_key: Optional[str], keys_exist: bool = True,
                     anonymous: Optional[bytes | str] = None) -> str:
    """The tier for a key's registry record; ``keys_exist=False`` (open mode): any key is normal.
    A caller without a key gets the policy's ``anonymous`` tier; with none set, normal in open mode
    and refused once keys exist (as the enqueue script decides)."""
    if not api_key:
        rule = _s(anonymous) if anonymous is not None else None
        if rule == "refuse" or (rule is None and keys_exist):
            raise AuthError(KEY_REQUIRED)
        return rule if rule in TIERS else "normal"
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


@dataclass(frozen=True)
class Read:
    """A read ``tier_steps`` asks for: ``HGET key field``, or ``EXISTS key`` when ``field`` is None."""
    key: str
    field: Optional[str] = None


def tier_steps(gk: GlobalKeys, api_key: Optional[str], floor: Optional[str] = None):
    """The tier the admin's registry gives ``api_key`` (lowered to ``floor``), as the reads it needs
    (``Read``): ``resolve_tier`` runs it, and ``AsyncClient.tier`` awaits it."""
    record = (yield Read(gk.api_keys, key_hash(api_key))) if api_key else None
    keys_exist = record is not None or bool((yield Read(gk.api_keys)))
    anonymous = None if api_key else (yield Read(gk.policy, "anonymous"))
    tier = tier_from_record(record, api_key, keys_exist, anonymous)
    return lower_tier(tier, floor) if floor else tier


def resolve_tier(redis, registry_key: str | GlobalKeys, api_key: Optional[str], floor: Optional[str] = None) -> str:
    return run_steps(tier_steps(_gk(registry_key), api_key, floor),
                     lambda op: redis.hget(op.key, op.field) if op.field else redis.exists(op.key))


def auth_mode(keys_exist: bool, anonymous: Optional[bytes | str]) -> str:
    """What a caller meets, in a line (the gateway's start-up log, ``mlxq tiers``)."""
    rule = _s(anonymous) if anonymous is not None else None
    if not keys_exist:
        if rule == "refuse":
            return "no API key is registered, and callers without one are refused (--anonymous refuse)"
        return "OPEN: no API key is registered, every caller (any token) is served at the normal tier"
    if rule in TIERS:
        return f"keys required; callers without one are served at the {rule} tier (--anonymous {rule})"
    return "keys required: a request without a key gets 401"


def copy_field(kh: str) -> str:
    """The field of a key in the per-model copies: sha1 of its sha256 (the enqueue script's
    ``redis.sha1hex(key_hash)``)."""
    return hashlib.sha1(kh.encode()).hexdigest()


def _gk(registry_key: str | GlobalKeys) -> GlobalKeys:
    if isinstance(registry_key, GlobalKeys):
        return registry_key
    return GlobalKeys(registry_key.rsplit(":apikeys", 1)[0])


def generate_key() -> str:
    """A new random key: 32 bytes of ``secrets``, url-safe."""
    return "mlxq-" + secrets.token_urlsafe(32)


def add_key(redis, registry_key: str | GlobalKeys, api_key: str, tier: str, name: Optional[str] = None,
            admin: bool = False) -> None:
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}")
    if len(api_key) < MIN_KEY_LENGTH:
        raise ValueError(f"API keys must be at least {MIN_KEY_LENGTH} characters")
    gk = _gk(registry_key)
    h = key_hash(api_key)
    if name is not None:
        if not name.strip():
            raise ValueError("a key's name must not be empty")
        holder = _hash_of_name(redis, gk, name)
        if holder is not None and holder != h:
            raise ValueError(f"a key named {name!r} exists already (names are unique: revoke it first, or "
                             "pick another)")
    redis.hset(gk.api_key_info, h, json.dumps({"name": name, "admin": bool(admin), "created": int(time.time())}))
    redis.hset(gk.api_keys, h, tier)
    _publish_key(redis, gk, h, tier)


def set_webhook_secret(redis, registry_key: str | GlobalKeys, name: Optional[str], secret: str) -> None:
    """Store ``secret`` as the one that signs the webhooks of the jobs of the key named ``name`` (None:
    of callers without a key), in ``GlobalKeys.webhook_secrets`` under the key's copy field."""
    gk = _gk(registry_key)
    if name is None:
        field = "anonymous"
    else:
        h = _hash_of_name(redis, gk, name)
        if h is None:
            raise ValueError(f"no key named {name!r} (`mlxq keys list` shows the names)")
        field = copy_field(h)
    redis.hset(gk.webhook_secrets, field, secret)


def _hash_of_name(redis, gk: GlobalKeys, name: str) -> Optional[str]:
    for h, raw in redis.hgetall(gk.api_key_info).items():
        if _info(raw).get("name") == name:
            return _s(h)
    return None


def key_label(raw_info) -> str:
    """A key's name as metrics show it (``api_key_info``'s record): "unnamed" for a key without one."""
    return str(_info(raw_info).get("name") or "unnamed")


def _info(raw) -> dict:
    try:
        info = json.loads(_s(raw))
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def list_keys(redis, registry_key: str | GlobalKeys) -> list[dict]:
    """Every registered key as ``{name, tier, admin, revoked, created}``: never the key or its hash."""
    gk = _gk(registry_key)
    info = {_s(h): _info(raw) for h, raw in redis.hgetall(gk.api_key_info).items()}
    rows = []
    for h, value in redis.hgetall(gk.api_keys).items():
        value, meta = _s(value), info.get(_s(h), {})
        rows.append({"name": meta.get("name"), "tier": value.split(":", 1)[-1], **key_limits(redis, gk, _s(h)),
                     "admin": bool(meta.get("admin")), "revoked": value.startswith(REVOKED),
                     "created": meta.get("created")})
    return sorted(rows, key=lambda r: (r["revoked"], r["name"] or "", r["created"] or 0))


def is_admin(redis, registry_key: str | GlobalKeys, api_key: Optional[str]) -> bool:
    """Whether ``api_key`` is a live key with the admin role."""
    if not api_key:
        return False
    gk = _gk(registry_key)
    h = key_hash(api_key)
    tier = redis.hget(gk.api_keys, h)
    if tier is None or _s(tier).startswith(REVOKED):
        return False
    return bool(_info(redis.hget(gk.api_key_info, h) or b"{}").get("admin"))


def revoke_key(redis, registry_key: str | GlobalKeys, api_key: str) -> bool:
    return _revoke(redis, _gk(registry_key), key_hash(api_key))


def revoke_name(redis, registry_key: str | GlobalKeys, name: str) -> bool:
    """Revoke the key of this name (``mlxq keys revoke --name``: no secret needed)."""
    gk = _gk(registry_key)
    h = _hash_of_name(redis, gk, name)
    return h is not None and _revoke(redis, gk, h)


def _revoke(redis, gk: GlobalKeys, h: str) -> bool:
    old = redis.hget(gk.api_keys, h)
    if old is None:
        return False
    old = _s(old)
    value = old if old.startswith(REVOKED) else f"{REVOKED}:{old}"
    redis.hset(gk.api_keys, h, value)
    _publish_key(redis, gk, h, value)
    return True


def _models(redis, gk: GlobalKeys) -> list[str]:
    """Every model that has (or should have) a copy: the registered ones and the copied ones."""
    return sorted({_s(m) for m in redis.hkeys(gk.models)} | {_s(m) for m in redis.smembers(gk.policy_models)})


def _publish_key(redis, gk: GlobalKeys, h: str, value: str) -> None:
    version = redis.incr(gk.policy_version)
    for model in _models(redis, gk):
        mk = gk.model_keys(model)
        redis.hset(mk.key_copy, copy_field(h), value)
        redis.hset(mk.policy, "version", version)


def set_policy(redis, gk: GlobalKeys, offsets: Optional[dict[str, float]] = None,
               max_queued: Optional[int] = None, anonymous: Optional[str] = None) -> dict:
    """Store tier offsets (seconds), the per-tier queue bound and the tier of callers with no
    key (normal, low, refuse; 'default': unset, refused once keys exist); then copy them to every model's slot."""
    mapping: dict = {}
    for tier, value in (offsets or {}).items():
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}: expected one of {TIERS}")
        mapping[f"offset:{tier}"] = float(value)
    if max_queued is not None:
        if int(max_queued) < 1:
            raise ValueError("max_queued must be positive")
        mapping["max_queued"] = int(max_queued)
    if anonymous is not None and anonymous != "default":
        if anonymous not in ANONYMOUS_CHOICES:
            raise ValueError(f"anonymous must be one of {ANONYMOUS_CHOICES} (or default)")
        mapping["anonymous"] = anonymous
    # back to the default: refused once keys exist
    _store_policy(redis, gk, mapping, ("anonymous",) if anonymous == "default" else ())
    return get_policy(redis, gk)


def _store_policy(redis, gk: GlobalKeys, mapping: dict, drop: tuple = ()) -> None:
    """Write policy fields (and drop ``drop``), then copy the policy to every model's slot."""
    if mapping:
        redis.hset(gk.policy, mapping=mapping)
    if drop:
        redis.hdel(gk.policy, *drop)
    redis.incr(gk.policy_version)
    from .slots import for_slot

    for model in _models(redis, gk):
        sync_model(redis, for_slot(redis, gk.model_keys(model).policy), gk, model)


# A key's limits, kept in the policy as ``<limit>:<sha1(sha256(key))>`` (the registry copy's field, the
# key's group in the fair-share scripts), so each model's slot has them:
# - weight: its share of its tier against the other keys with queued work there (pick.lua serves their
#   groups in turn, a key of weight 2 twice as often as one of weight 1);
# - inflight: the most of its jobs leased at once (per model); past it, its jobs wait at pick and pull;
# - quota: the most tokens (prompt and completion) its jobs may use per UTC day on a model (as OpenAI's
#   limits are per model); past it, enqueue refuses its new jobs until the next day.
DEFAULT_WEIGHT = 1.0
MAX_WEIGHT = 1000.0


def set_limits(redis, gk: GlobalKeys, name: str, weight: Optional[float] = None,
               max_inflight: Optional[int] = None, daily_tokens: Optional[int] = None) -> None:
    """Set the fair-share weight, the cap on jobs in flight and the daily token quota of the key named
    ``name`` (``mlxq keys set``); 0 lifts the cap or the quota, weight 1 is the default."""
    h = _hash_of_name(redis, gk, name)
    if h is None:
        raise ValueError(f"no key named {name!r} (`mlxq keys list` shows them)")
    group = copy_field(h)
    mapping: dict = {}
    drop: list = []
    if weight is not None:
        weight = float(weight)
        if not 0 < weight <= MAX_WEIGHT:
            raise ValueError(f"a key's weight must be above 0 and at most {MAX_WEIGHT:g}, got {weight:g}")
        (drop.append(f"weight:{group}") if weight == DEFAULT_WEIGHT else mapping.update({f"weight:{group}": weight}))
    if max_inflight is not None:
        if int(max_inflight) < 0:
            raise ValueError(f"a key's cap on jobs in flight must be 0 (none) or more, got {max_inflight}")
        (drop.append(f"inflight:{group}") if int(max_inflight) == 0
         else mapping.update({f"inflight:{group}": int(max_inflight)}))
    if daily_tokens is not None:
        if int(daily_tokens) < 0:
            raise ValueError(f"a key's daily token quota must be 0 (none) or more, got {daily_tokens}")
        (drop.append(f"quota:{group}") if int(daily_tokens) == 0
         else mapping.update({f"quota:{group}": int(daily_tokens)}))
    _store_policy(redis, gk, mapping, tuple(drop))


def key_limits(redis, gk: GlobalKeys, kh: str) -> dict:
    """``{weight, max_inflight, daily_tokens}`` of the key whose sha256 is ``kh`` (None: no cap, no quota)."""
    group = copy_field(kh)
    weight, cap, quota = redis.hmget(gk.policy, f"weight:{group}", f"inflight:{group}", f"quota:{group}")
    return {"weight": float(weight) if weight is not None else DEFAULT_WEIGHT,
            "max_inflight": int(cap) if cap is not None else None,
            "daily_tokens": int(quota) if quota is not None else None}


def key_names(redis, gk: GlobalKeys) -> dict[str, str]:
    """Each key's group (sha1(sha256(key)), as the usage and fair-share records name it) -> its name;
    "-" (jobs without a key) -> "(no key)"."""
    info = {_s(h): raw for h, raw in redis.hgetall(gk.api_key_info).items()}
    names = {copy_field(_s(h)): key_label(info[_s(h)]) if _s(h) in info else "unnamed"
             for h in redis.hkeys(gk.api_keys)}
    return {**names, "-": "(no key)"}


def get_policy(redis, gk: GlobalKeys) -> dict:
    raw = {_s(k): _s(v) for k, v in redis.hgetall(gk.policy).items()}
    return {"offsets": {t: float(raw.get(f"offset:{t}", DEFAULT_TIER_OFFSETS[t])) for t in TIERS},
            "max_queued": int(raw.get("max_queued", 10_000)), "anonymous": raw.get("anonymous", "default"),
            "auth": auth_mode(bool(redis.exists(gk.api_keys)), raw.get("anonymous"))}


def seed_policy(redis, gk: GlobalKeys, offsets: dict[str, float], max_queued: int) -> None:
    """A worker's settings fill in what no admin has set (HSETNX: never overrides ``mlxq tiers``)."""
    for tier, value in offsets.items():
        redis.hsetnx(gk.policy, f"offset:{tier}", float(value))
    redis.hsetnx(gk.policy, "max_queued", int(max_queued))


def sync_model(redis, slot_redis, gk: GlobalKeys, model: str) -> str:
    """Copy the registry and the policy into ``model``'s slot (one MULTI there); returns the version."""
    redis.sadd(gk.policy_models, model)  # before reading: a later admin change will write this copy too
    version = _s(redis.get(gk.policy_version) or b"0")
    registry = {copy_field(_s(h)): v for h, v in redis.hgetall(gk.api_keys).items()}
    policy = redis.hgetall(gk.policy)
    mk = gk.model_keys(model)
    pipe = slot_redis.pipeline(transaction=True)
    pipe.delete(mk.key_copy, mk.policy)
    if registry:
        pipe.hset(mk.key_copy, mapping=registry)
    pipe.hset(mk.policy, mapping={**policy, "version": version})
    pipe.execute()
    return version


def sync_if_stale(redis, slot_redis, gk: GlobalKeys, model: str) -> bool:
    """Re-copy when the model's copy is behind the global version (two reads when it is not)."""
    version = _s(redis.get(gk.policy_version) or b"0")
    have = slot_redis.hget(gk.model_keys(model).policy, "version")
    if have is not None and _s(have) == version:
        return False
    sync_model(redis, slot_redis, gk, model)
    return True


def usage(redis, gk: GlobalKeys, days: int = 1, models: Optional[list[str]] = None) -> list[dict]:
    """The tokens of each key's finished jobs per UTC day on ``models`` (default: every model), the last ``days`` days by the
    server's clock (ModelKeys.usage): ``{day, model, key, prompt_tokens, completion_tokens, jobs}`` rows,
    the key by its name (never the key or its hash; "unregistered" for a key used in open mode)."""
    from .slots import for_slot

    if days < 1:
        raise ValueError(f"days must be 1 or more, got {days}")
    sec, _ = redis.time()
    first = int(sec) // 86400 - days + 1
    names = key_names(redis, gk)
    rows: dict[tuple, dict] = {}
    for model in models if models is not None else _models(redis, gk):
        mk = gk.model_keys(model)
        for field, value in for_slot(redis, mk.usage).hgetall(mk.usage).items():
            day, _, rest = _s(field).partition("|")
            group, _, kind = rest.rpartition("|")
            if not day.isdigit() or int(day) < first or kind not in ("prompt", "completion", "jobs"):
                continue
            date = time.strftime("%Y-%m-%d", time.gmtime(int(day) * 86400))
            row = rows.setdefault((date, model, group), {"day": date, "model": model,
                                                         "key": names.get(group, "unregistered"),
                                                         "prompt_tokens": 0, "completion_tokens": 0, "jobs": 0})
            row["prompt_tokens" if kind == "prompt" else "completion_tokens" if kind == "completion" else "jobs"] += int(value)
    return sorted(rows.values(), key=lambda r: (r["day"], r["model"], r["key"]))
