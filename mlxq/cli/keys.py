"""``mlxq keys`` (create, add, revoke, list), ``mlxq tiers`` and ``mlxq acl-producer``: who may submit,
at which tier.

No secret is ever taken as an argument, where it would land in shell history and ``ps``: ``keys create``
makes one and prints it once; ``keys add`` and ``keys revoke`` read the key from stdin (or the variable
``--key-env`` names); ``acl-producer`` reads the password the same way (``--password-env``).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from datetime import datetime, timezone
from typing import Optional

from ..shared.apikeys import ANONYMOUS_CHOICES, KEY_RULES, MIN_KEY_LENGTH
from ..shared.settings import TIERS, Settings
from .options import add_shared

ON_ARGV = ("a secret on the command line lands in shell history and in `ps` for every user of the host; "
           "give it on stdin ({example}) or name an environment variable that holds it ({flag} VAR)")


def _prefix() -> str:
    """The deployment's key prefix, ``MLXQ_PREFIX``, as the workers and clients read it."""
    return Settings.from_env().prefix


def read_secret(what: str, env_name: Optional[str]) -> str:
    """A secret from the environment variable named, else stdin: one line, or a prompt without echo on a
    terminal."""
    if env_name:  # a variable the operator named to hand over a secret (no setting: any name will do)
        value = os.environ.get(env_name)
        if not value:
            raise ValueError(f"the environment variable {env_name} that should hold the {what} is not set")
        return value
    if sys.stdin is None:
        raise ValueError(f"no {what}: give it on stdin")
    if sys.stdin.isatty():
        return getpass.getpass(f"{what}: ")
    value = sys.stdin.readline().strip()
    if not value:
        raise ValueError(f"no {what} on stdin")
    return value


def _refuse_argv(args, secret_attr: str, example: str, flag: str) -> None:
    if getattr(args, secret_attr, None) is not None:
        raise ValueError(ON_ARGV.format(example=example, flag=flag))


def _connect(args):
    from ..producer.client import connect
    from ..shared.keys import GlobalKeys

    settings = Settings.from_env()
    return connect(args.redis_url, settings.redis_outage_s), GlobalKeys(settings.prefix)


def cmd_keys(args) -> int:
    from ..shared import apikeys

    if args.action == "create":
        r, gk = _connect(args)
        key = apikeys.generate_key()
        apikeys.add_key(r, gk, key, args.tier, name=args.name, admin=args.admin)
        if args.weight is not None or args.max_inflight is not None or args.daily_tokens is not None:
            apikeys.set_limits(r, gk, args.name, args.weight, args.max_inflight, args.daily_tokens)
        role = ", admin" if args.admin else ""
        print(f"key {args.name!r} created at tier {args.tier}{role}; it is shown this once: keep it now",
              file=sys.stderr)
        print(key)
        return 0
    if args.action == "add":
        _refuse_argv(args, "key", "`mlxq keys add --tier low < keyfile`", "--key-env")
        key = read_secret("API key", args.key_env)
        r, gk = _connect(args)
        apikeys.add_key(r, gk, key, args.tier, name=args.name, admin=args.admin)
        print(f"key {args.name or '(unnamed)'} added at tier {args.tier}" + (", admin" if args.admin else ""))
        return 0
    if args.action == "set":
        r, gk = _connect(args)
        apikeys.set_limits(r, gk, args.name, args.weight, args.max_inflight, args.daily_tokens)
        limits = next(k for k in apikeys.list_keys(r, gk) if k["name"] == args.name)
        print(f"key {args.name!r}: weight {limits['weight']:g}, at most "
              f"{limits['max_inflight'] or 'any number of'} jobs in flight, "
              f"{limits['daily_tokens'] or 'unlimited'} tokens a day")
        return 0
    if args.action == "revoke":
        _refuse_argv(args, "key", "`mlxq keys revoke < keyfile`", "--key-env")
        if args.name:
            r, gk = _connect(args)
            done = apikeys.revoke_name(r, gk, args.name)
        else:
            key = read_secret("API key", args.key_env)
            r, gk = _connect(args)
            done = apikeys.revoke_key(r, gk, key)
        print("revoked" if done else "unknown key")
        return 0 if done else 1
    if args.action == "webhook-secret":
        from ..producer.webhooks import new_secret

        if (args.name is None) == (not args.anonymous):
            raise ValueError("give --name NAME (a key's) or --anonymous (callers without a key), one of them")
        r, gk = _connect(args)
        secret = new_secret()
        apikeys.set_webhook_secret(r, gk, args.name, secret)
        print(f"webhook secret of {'callers without a key' if args.anonymous else repr(args.name)} set (it "
              "replaces any before); it is shown this once: give it to the receiver now", file=sys.stderr)
        print(secret)
        return 0
    r, gk = _connect(args)
    rows = apikeys.list_keys(r, gk)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(apikeys.auth_mode(bool(rows), r.hget(gk.policy, "anonymous")))
    for row in rows:
        when = (datetime.fromtimestamp(row["created"], timezone.utc).strftime("%Y-%m-%d %H:%M")
                if row["created"] else "-")
        flags = " ".join(x for x in ("admin" if row["admin"] else "", "REVOKED" if row["revoked"] else "") if x)
        weight = f"weight {row['weight']:g}" if row["weight"] != apikeys.DEFAULT_WEIGHT else ""
        cap = f"at most {row['max_inflight']} in flight" if row["max_inflight"] else ""
        quota = f"{row['daily_tokens']} tokens a day" if row["daily_tokens"] else ""
        flags = " ".join(x for x in (flags, weight, cap, quota) if x)
        print(f"{row['name'] or '(unnamed)':24} {row['tier']:7} {when:16} {flags}".rstrip())
    return 0


def cmd_tiers(args) -> int:
    """Tier offsets, the per-tier queue bound and the tier of key-less callers, stored in Redis
    (the enqueue script reads them there; every model's slot gets a copy)."""
    from ..shared import apikeys

    r, gk = _connect(args)
    offsets = {}
    for part in args.offsets or []:
        name, _, value = part.partition("=")
        if name not in TIERS or not value:
            raise ValueError(f"expected tier=seconds with tier in {TIERS}, got {part!r}")
        offsets[name] = float(value)
    if offsets or args.max_queued is not None or args.anonymous is not None:
        policy = apikeys.set_policy(r, gk, offsets, args.max_queued, args.anonymous)
    else:
        policy = apikeys.get_policy(r, gk)
    print(json.dumps(policy, indent=2))
    return 0


def cmd_usage(args) -> int:
    """Tokens per key per UTC day on every model (counted by the workers at each job's end)."""
    from ..shared import apikeys

    r, gk = _connect(args)
    rows = apikeys.usage(r, gk, args.days)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'day':10}  {'model':16} {'key':24} {'prompt':>10} {'completion':>10} {'jobs':>7}")
    for row in rows:
        print(f"{row['day']:10}  {row['model']:16} {row['key']:24} {row['prompt_tokens']:>10} "
              f"{row['completion_tokens']:>10} {row['jobs']:>7}")
    return 0


def cmd_acl(args) -> int:
    """Print the ACL SETUSER line of the producer recipe (mlxq.shared.acl)."""
    from ..shared.acl import producer_acl_line

    _refuse_argv(args, "password", "`mlxq acl-producer USER < passwordfile`", "--password-env")
    print(producer_acl_line(args.user, read_secret("password", args.password_env), _prefix()))
    return 0


def _secret_options(p: argparse.ArgumentParser, what: str, dest: str, env_flag: str) -> None:
    # the old spelling (the secret as an argument) is still parsed, to be refused with why
    p.add_argument(dest, nargs="?", help=argparse.SUPPRESS)
    p.add_argument(env_flag, metavar="VAR",
                   help=f"read the {what} from this environment variable (default: from stdin)")


WEIGHT_HELP = ("the key's share of its tier against other keys with jobs queued there: a key of weight 2 is "
               "served twice as often as one of weight 1 (default: 1)")
INFLIGHT_HELP = ("the most of the key's jobs running at once on a model; past it its jobs wait until one ends "
                 "(0: no cap, the default)")
QUOTA_HELP = ("the most tokens (prompt and completion) the key's jobs may use per UTC day on a model; past it "
              "new jobs are refused (429, Retry-After: the next day) (0: no quota, the default)")


def add_commands(sub) -> None:
    keys_help = "manage API keys (they set the tier)"
    p = sub.add_parser("keys", help=keys_help, description=f"{keys_help}. {KEY_RULES}")
    add_shared(p, "redis_url")
    ks = p.add_subparsers(dest="action", required=True)

    c = ks.add_parser("create", help="make a new random key, register it and print it (once)",
                      description=f"Make a random key, register it, and print it on stdout once (only its "
                                  f"sha256 is stored). {KEY_RULES}")
    add_shared(c, "redis_url")
    c.add_argument("--name", required=True, help="what `keys list` shows for it (unique; required)")
    c.add_argument("--tier", choices=TIERS, required=True, help="the tier the key's jobs run at (required)")
    c.add_argument("--admin", action="store_true",
                   help="the admin role: the operator's actions (jobs cancel, requeue, failed purge)")

    c.add_argument("--weight", type=float, help=WEIGHT_HELP)
    c.add_argument("--max-inflight", type=int, help=INFLIGHT_HELP)
    c.add_argument("--daily-tokens", type=int, help=QUOTA_HELP)

    st = ks.add_parser("set", help="set a key's share of its tier and its cap on jobs in flight (by --name)")
    add_shared(st, "redis_url")
    st.add_argument("--name", required=True, help="the key's name")
    st.add_argument("--weight", type=float, help=WEIGHT_HELP)
    st.add_argument("--max-inflight", type=int, help=INFLIGHT_HELP)
    st.add_argument("--daily-tokens", type=int, help=QUOTA_HELP)

    a = ks.add_parser("add", help=f"register a key you have (read from stdin; at least {MIN_KEY_LENGTH} "
                                  "characters)", description=KEY_RULES)
    add_shared(a, "redis_url")
    _secret_options(a, "key", "key", "--key-env")
    a.add_argument("--tier", choices=TIERS, required=True, help="the tier the key's jobs run at (required)")
    a.add_argument("--name", help="what `keys list` shows for it (unique) (default: unnamed)")
    a.add_argument("--admin", action="store_true", help="the admin role (see `keys create`)")

    r = ks.add_parser("revoke", help="refuse a key from now on, by --name or the key on stdin (its hash is kept)",
                      description=KEY_RULES)
    add_shared(r, "redis_url")
    _secret_options(r, "key", "key", "--key-env")
    r.add_argument("--name", help="the key's name (default: read the key itself from stdin)")

    w = ks.add_parser("webhook-secret", help="make the secret that signs a key's job webhooks, store it and "
                      "print it (once)", description="Make a new Standard Webhooks secret (whsec_...) for the "
                      "jobs of the key named --name (or of callers without a key: --anonymous), store it in Redis "
                      "(replacing any before) and print it once: the receiver verifies signatures with it.")
    add_shared(w, "redis_url")
    w.add_argument("--name", help="the key's name (no default: give it or --anonymous)")
    w.add_argument("--anonymous", action="store_true", help="the secret of jobs submitted without a key")

    ls = ks.add_parser("list", help="the registered keys: name, tier, role (never the key or its hash)",
                       description=KEY_RULES)
    add_shared(ls, "redis_url")
    ls.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("tiers", help="show or set tier offsets, the queue bound and the key-less tier (in Redis)")
    add_shared(p, "redis_url")
    p.add_argument("offsets", nargs="*", help="tier=seconds, e.g. high=0 normal=30 low=300")
    p.add_argument("--max-queued", type=int,
                   help="jobs waiting per tier before submit is refused (429) (default: unchanged; 10000 at first)")
    p.add_argument("--anonymous", choices=ANONYMOUS_CHOICES + ("default",),
                   help="callers with no API key: served at the normal or low tier, or refused; 'default': "
                        "served while no key is registered, refused (401) once one is (default: unchanged)")
    p.set_defaults(func=cmd_tiers)

    p = sub.add_parser("usage", help="tokens used per API key per UTC day on every model (by key name)")
    add_shared(p, "redis_url")
    p.add_argument("--days", type=int, default=1,
                   help="the last N UTC days, today included; 92 are kept (default: 1)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_usage)

    p = sub.add_parser("acl-producer", help="print the Redis ACL rule for a producer service (password on stdin)")
    p.add_argument("user", help="the Redis user name")
    _secret_options(p, "password", "password", "--password-env")
    add_shared(p)
    p.set_defaults(func=cmd_acl)
