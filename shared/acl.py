"""The Redis ACL recipe for producer services (see README, trust boundary).

A producer user may call mlxq's Functions (``FCALL``) and nothing that runs new
code (``EVAL``, ``EVALSHA``, ``SCRIPT``, ``FUNCTION LOAD``).  Redis checks the
commands a function runs against the caller's own ACL, so the recipe also
grants the few data commands the producer-side functions use, on the keys they
use, and withholds every write that decides priority: a producer cannot write a
queue, the counters, the key registry or its copies, or the policy.  Its jobs go
to the intake list; a worker's ``admit`` script (a trusted user) decides tier and
score there, from the key hash and the time of admission.

What a producer can still do, and why it is harmless:
* write fields of a job record whose 128-bit id it knows (its own): admission
  recomputes tier and score and keeps them, with the suspect flag, in a
  worker-only hash (ModelKeys.sched) that requeues, the reaper and pull read, so
  nothing it writes raises its priority or runs its job alone;
* push ids on the intake list: admission only places a queued, not yet admitted
  job, for the key hash its record names (which must be a valid key); it cannot
  trim the list or set its TTL (no LTRIM, and EXPIRE only on job keys), which would
  drop other producers' waiting jobs;
* read the slot copies of the key registry: their fields are sha1(sha256(key)),
  which do not let anyone present a key they do not hold.
"""

from __future__ import annotations

# Commands the producer side runs (directly or inside mlxq's functions).
PRODUCER_COMMANDS = (
    "+fcall", "+fcall_ro",  # mlxq's loaded functions; no +eval/+evalsha/+script/+function
    "+ping", "+client|setinfo", "+client|setname", "+time",
    "+cluster|slots", "+cluster|shards", "+cluster|nodes", "+command",  # cluster clients (slot map, command table)
    "+get", "+exists", "+hget", "+hgetall", "+hmget", "+hkeys", "+xrange", "+blpop",  # reads (blpop: its done list)
    "+hset", "+hdel", "+set", "+rpush", "+lpush", "+xadd",  # writes inside the functions (+expire: below)
    "+publish", "+spublish", "+subscribe", "+unsubscribe", "+ssubscribe", "+sunsubscribe",
)


def producer_key_rules(prefix: str = "mlxq") -> tuple[str, ...]:
    m = f"{{{prefix}:*}}"
    base = f"{prefix}:{m}"
    return (
        f"%R~{prefix}:models",  # which models are served
        f"%R~{base}:counts", f"%R~{base}:apikeys", f"%R~{base}:policy",  # read by enqueue
        f"~{base}:job:*", f"~{base}:idem:*", f"~{base}:events:*", f"~{base}:done:*",  # its own jobs
        f"%W~{base}:intake", f"%W~{base}:wake",  # hand jobs to the workers
        f"&{base}:chan:*", f"&{base}:cancel",  # token deltas; cancel requests
        # EXPIRE (a cancel request ends a job's record) on its own job's keys only, in a selector: with
        # the write access to the intake list above, EXPIRE (like LTRIM, which no producer gets) could
        # drop every other producer's jobs still waiting there
        f"(+expire ~{base}:job:* ~{base}:events:* ~{base}:done:*)",
    )


def producer_rules(password: str, prefix: str = "mlxq") -> list[str]:
    """``ACL SETUSER <name> <rules...>`` for a producer service."""
    return ["on", f">{password}", "resetkeys", "resetchannels", "-@all",
            *PRODUCER_COMMANDS, *producer_key_rules(prefix)]


def producer_acl_line(user: str, password: str, prefix: str = "mlxq") -> str:
    """The same recipe as one ``ACL SETUSER`` command line (for an ACL file or redis-cli)."""
    return " ".join(["ACL", "SETUSER", user, *producer_rules(password, prefix)])
