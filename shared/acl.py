"""The Redis ACL recipe for producer services (see docs/operations/acl.md, the trust boundary).

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
  trim, overwrite, pop or retype the list or set its TTL (the intake and wake
  lists only in a selector of FCALL, RPUSH and LPUSH; EXPIRE only on job keys,
  SET only on idempotency keys, BLPOP only on done lists), which would drop other
  producers' waiting jobs, show their ids, or make every submit fail (submit
  declares the lists, so the user may read them: no command it has reads a list
  but BLPOP);
* read the slot copies of the key registry: their fields are sha1(sha256(key)),
  which do not let anyone present a key they do not hold.
"""

from __future__ import annotations

from .keys import GlobalKeys, ModelKeys

# Commands the producer side runs (directly or inside mlxq's functions).
PRODUCER_COMMANDS = (
    "+fcall", "+fcall_ro",  # mlxq's loaded functions; no +eval/+evalsha/+script/+function
    "+ping", "+client|setinfo", "+client|setname", "+time",
    "+cluster|slots", "+cluster|shards", "+cluster|nodes", "+command",  # cluster clients (slot map, command table)
    "+get", "+exists", "+hget", "+hgetall", "+hmget", "+hkeys", "+xrange",  # reads (+blpop: below)
    "+hset", "+hdel", "+rpush", "+lpush", "+xadd",  # writes inside the functions (+set, +expire: below)
    "+publish", "+spublish", "+subscribe", "+unsubscribe", "+ssubscribe", "+sunsubscribe",
)


def producer_key_rules(prefix: str = "mlxq") -> tuple[str, ...]:
    """The keys and channels a producer may reach, as glob patterns over every model's keys."""
    m = ModelKeys("*", prefix)
    job, idem, events, done = m.job("*"), m.idempotency_prefix + "*", m.events("*"), m.done("*")
    return (
        f"%R~{GlobalKeys(prefix).models}",  # which models are served
        f"%R~{m.counts}", f"%R~{m.key_copy}", f"%R~{m.policy}", f"%R~{m.usage}",  # read by check
        f"~{job}", f"~{idem}", f"~{events}", f"~{done}",  # its own jobs
        f"&{m.channel('*')}", f"&{m.cancel_channel}",  # token deltas; cancel requests
        # hand jobs to the workers, in a selector of their own: submit declares both lists (and under
        # FCALL a declared key needs read access too), and it pushes on them; no other command reaches
        # them (in the root rule, HSET or XADD could make a hash or a stream of an empty list, and every
        # producer's submit would fail with WRONGTYPE, as would the workers' pushes to wake)
        f"(+fcall +rpush +lpush ~{job} ~{idem} ~{m.intake} ~{m.wake})",
        # EXPIRE (a cancel request ends a job's record), SET (an idempotency key) and BLPOP (a job's done
        # list) on those keys only, each in a selector: with the access to the intake list above, EXPIRE
        # or SET (like LTRIM, which no producer gets) could drop every other producer's jobs still
        # waiting there, and BLPOP would pop them, and show their ids
        f"(+expire ~{job} ~{events} ~{done})",
        f"(+set ~{idem})",
        f"(+blpop ~{done})",
    )


def producer_rules(password: str, prefix: str = "mlxq") -> list[str]:
    """``ACL SETUSER <name> <rules...>`` for a producer service."""
    # clearselectors: applied again to an existing user (an upgrade), the rule replaces its selectors
    return ["on", f">{password}", "resetkeys", "resetchannels", "clearselectors", "-@all",
            *PRODUCER_COMMANDS, *producer_key_rules(prefix)]


def producer_acl_line(user: str, password: str, prefix: str = "mlxq") -> str:
    """The same recipe as one ``ACL SETUSER`` command line (for an ACL file or redis-cli)."""
    return " ".join(["ACL", "SETUSER", user, *producer_rules(password, prefix)])
