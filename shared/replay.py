"""A finished job's event stream, read back from the compacted record in its job hash.

When a worker completes a job, ``complete.lua`` folds the job's event stream into the record's
``events`` field and deletes the stream (``shared/lua/_compact.lua`` says why and how): each delta
is kept as the slices of the result it covered.  ``expand`` turns that record and the result back
into the stream's payloads, each delta as its worker wrote it (same text pieces, token ids, offsets,
sequence numbers, reasoning, tool calls, logprobs), so a reader that got part of the stream live
continues from it with no token twice and none lost, and a late one sees the live stream's deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from . import codec

FIELD = "events"  # the job hash's field that holds the record
VERSION = 1


class ReplayError(ValueError):
    """A record this reader cannot expand (another version, or not a record at all)."""


@dataclass
class _Lane:
    """One sample's position in its slices of the result, as the compaction walked them."""

    out: dict
    n: int = 0  # token ids
    c: int = 0  # text characters
    tb: int = 0  # text bytes
    rc: int = 0  # reasoning characters
    rb: int = 0  # reasoning bytes
    s: int = 0  # deltas
    k: int = 0  # tool calls completed
    call: int = -1  # the call whose arguments are streaming
    po: int = 0  # its arguments' characters
    pb: int = 0  # and bytes
    pi: Optional[str] = None
    pn: Optional[str] = None

    def __post_init__(self):
        self.ids = codec.unpack_ids(self.out.get("token_ids") or [])
        self.text = (self.out.get("text") or "").encode()
        self.reasoning = (self.out.get("reasoning") or "").encode()


def expand(packed: bytes, result: bytes) -> list[list[dict]]:
    """The payloads of the stream ``packed`` (the ``events`` field) was made of, in order, each a
    list of wire deltas (one, or one per sample of a step); ``result``: the ``result`` field."""
    rec, res = codec.unpack(packed), codec.unpack(result)
    if not (isinstance(rec, list) and len(rec) >= 2 and rec[0] == VERSION and isinstance(res, dict)):
        raise ReplayError(f"not a version-{VERSION} events record")
    xmode = bool(rec[1])
    samples = res.get("samples") or None
    lanes: dict[int, _Lane] = {}
    attempt = [1]

    def lane_of(x: int) -> _Lane:
        if x not in lanes:
            lanes[x] = _Lane(samples[x] if samples else res)
        return lanes[x]

    def delta(e: Any) -> dict:
        if isinstance(e, int):
            tlen, x = divmod(e, 16) if xmode else (e, None)
            e = {"t": tlen} if x is None else {"t": tlen, "x": x}
        return _delta(e, lane_of(e.get("x") or 0), attempt, res)

    out = []
    for entry in rec[2:]:
        out.append([delta(e) for e in entry] if isinstance(entry, list) else [delta(entry)])
    return out


def _delta(e: dict, lane: _Lane, attempt: list, res: dict) -> dict:
    """One wire delta back from its compacted form ``e`` (mlxq_compact_delta in _compact.lua)."""
    attempt[0] = e.get("a", attempt[0])
    count, tlen = e.get("i", 1), e.get("t", 0)
    text = lane.text[lane.tb:lane.tb + tlen].decode()
    ids = lane.ids[lane.n:lane.n + count]
    d: dict[str, Any] = {"a": attempt[0], "s": lane.s + 1, "n": lane.n, "c": lane.c, "t": text, "i": ids}
    if e.get("lp"):
        d["lp"] = list(lane.out["logprobs"][lane.n:lane.n + count])
    if "r" in e:
        d["r"], d["rc"] = lane.reasoning[lane.rb:lane.rb + e["r"]].decode(), lane.rc
        lane.rb += e["r"]
        lane.rc += len(d["r"])
    if "tc" in e or "pa" in e:
        d["k"] = lane.k
    if "tc" in e:
        d["tc"] = list(lane.out["tool_calls"][lane.k:lane.k + e["tc"]])
        lane.k += e["tc"]
    if "pa" in e:
        if lane.call != lane.k:
            lane.call, lane.po, lane.pb, lane.pi, lane.pn = lane.k, 0, 0, None, None
        lane.pi, lane.pn = e.get("pi", lane.pi), e.get("pn", lane.pn)
        if isinstance(e["pa"], str):  # a call cut short: its pieces as they were
            pa = e["pa"]
        else:
            args = lane.out["tool_calls"][lane.k]["function"]["arguments"].encode()
            pa = args[lane.pb:lane.pb + e["pa"]].decode()
        d["pi"], d["pn"], d["pa"], d["po"] = lane.pi, lane.pn, pa, lane.po
        lane.po += len(pa)
        lane.pb += len(pa.encode())
    if e.get("sd"):
        d["sd"] = res["stats"]["seed"]
    for key, v in e.items():  # kept as they were: f, e, xn, x, ...
        if key not in _DERIVED:
            d[key] = v
    lane.n += len(ids)
    lane.c += len(text)
    lane.tb += tlen
    lane.s += 1
    return d


_DERIVED = frozenset(("a", "t", "i", "lp", "r", "tc", "pa", "pi", "pn", "po", "sd"))


def read_payloads(r, keys, job_id: str) -> list[list[dict]]:
    """Every payload a job's event stream holds, each a list of wire deltas, from the stream or, once
    the job ended and its stream was compacted, from its record (for tools and tests: a reader that
    follows a job uses ``JobCore``).  A terminal event (cancel, dead letter) is a list of its fields."""
    from .schemas import wire_deltas

    out = []
    for _, fields in r.xrange(keys.events(job_id)):
        f = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
        if "d" in f:
            out.append(wire_deltas(codec.unpack(f["d"])))
        else:
            out.append([{k: v.decode() if isinstance(v, bytes) else v for k, v in f.items()}])
    if out:
        return out
    packed, result = r.hmget(keys.job(job_id), FIELD, "result")
    return expand(packed, result) if packed and result else []
