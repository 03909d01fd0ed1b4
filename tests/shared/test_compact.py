"""A finished job's event stream is compacted into its record as it ends (complete.lua +
_compact.lua), and read back by ``mlxq.shared.replay``: a late subscriber gets exactly the deltas a
live one got, a reader that read part of the stream resumes after the compaction with exactly the
rest, and a finished job costs at most 2 KiB of Redis plus its text and token ids.  Real Valkey; the
scenarios are written by the real scripts (a test plays the worker), then by the real worker."""

from __future__ import annotations

import asyncio

import pytest
import redis

from mlxq import AsyncClient, Client
from mlxq.producer.core import JobCore
from mlxq.shared import codec, replay
from mlxq.shared.keys import ModelKeys
from mlxq.shared.protocol import Queue
from mlxq.shared.schemas import Delta, Result

from workerkit import fast_settings, publish_deltas, running_worker

OWNER = "w:1"
KEYS = ModelKeys("tiny")
BUDGET = 2048  # bytes of Redis per finished job, beyond its text and its token ids (msgpack)


def wire(a=1, s=1, n=0, c=0, t="", i=(), **kw) -> dict:
    return {"a": a, "s": s, "n": n, "c": c, "t": t, "i": list(i), **kw}


def stream_of(pieces, sample=None, start_s=1, **first) -> list[dict]:
    """Wire deltas of one lane, one per (text, ids) piece, numbered as a worker numbers them."""
    out, n, c = [], 0, 0
    for j, (text, ids) in enumerate(pieces):
        d = wire(s=start_s + j, n=n, c=c, t=text, i=ids, **(first if j == 0 else {}))
        if sample is not None:
            d["x"] = sample
        out.append(d)
        n, c = n + len(ids), c + len(text)
    return out


def result_of(job_id, text, ids, **kw) -> dict:
    return {"id": job_id, "text": text, "token_ids": list(ids), "finish_reason": kw.pop("f", "stop"),
            "stats": {"seed": 2**63 + 12345, "generated_tokens": len(ids)}, **kw}


CALL = {"id": "call_" + "a" * 24, "type": "function", "function": {"name": "get", "arguments": '{"q": "né"}'}}
LP = [{"token": 5, "logprob": -0.25, "top": [[5, -0.25], [6, -1.5]]},
      {"token": 6, "logprob": -1.0, "top": [[6, -1.0]]},
      {"token": 7, "logprob": float("-inf"), "top": []}]


def plain_job(job_id):
    """n == 1: multi-byte text, a token whose text comes with the next one, the seed on the first
    delta, a takeover (attempt 2) mid-stream, a multi-token delta and a last delta with no token."""
    pieces = [("Il", [1]), (" était", [2]), ("", [3]), (" é🙂", [4]), (" fois", [5, 6]), ("", [])]
    deltas = stream_of(pieces, sd=2**63 + 12345)
    for d in deltas[3:]:
        d["a"] = 2
    deltas[-1]["f"] = "length"
    return [[d] for d in deltas], result_of(job_id, "Il était é🙂 fois", [1, 2, 3, 4, 5, 6], f="length")


def chat_job(job_id):
    """Reasoning, a tool call whose arguments stream in pieces (then complete), logprobs."""
    d = [wire(s=1, n=0, c=0, t="", i=[5], r="Je pense", rc=0, lp=LP[:1]),
         wire(s=2, n=1, c=0, t="", i=[6], r=" à é", rc=8, lp=LP[1:2]),
         wire(s=3, n=2, c=0, t="Ok", i=[7], k=0, pi=CALL["id"], pn="get", pa='{"q": ', po=0, lp=LP[2:3]),
         wire(s=4, n=3, c=2, t="", i=[8], k=0, pi=CALL["id"], pn="get", pa='"n', po=6, lp=[LP[0]]),
         wire(s=5, n=4, c=2, t="", i=[9, 10], k=0, tc=[CALL], f="tool_calls", lp=LP[1:3])]
    res = result_of(job_id, "Ok", [5, 6, 7, 8, 9, 10], f="tool_calls", reasoning="Je pense à é",
                    tool_calls=[CALL], logprobs=LP + [LP[0]] + LP[1:3])
    return [[x] for x in d], res


def cut_call_job(job_id):
    """A call cut short by max_tokens: its arguments are in no result, and stay as they streamed."""
    d = [wire(s=1, n=0, c=0, t="Hi", i=[5]),
         wire(s=2, n=1, c=2, t="", i=[6], k=0, pi=CALL["id"], pn="get", pa='{"q"', po=0),
         wire(s=3, n=2, c=2, t="", i=[7], k=0, pi=CALL["id"], pn="get", pa=': "x', po=4, f="length")]
    return [[x] for x in d], result_of(job_id, "Hi", [5, 6, 7], f="length")


def samples_job(job_id):
    """n == 2: one payload (a list) per step, a step with one sample's delta as a plain map."""
    a = stream_of([("A", [1]), ("B", [2]), ("C", [3])], sample=0)
    b = stream_of([("x", [4]), ("yé", [5])], sample=1)
    a[-1].update(f="length", xn=2)
    b[-1].update(f="stop", xn=2)
    payloads = [[a[0], b[0]], [a[1], b[1]], a[2]]
    samples = [dict(result_of(job_id, "ABC", [1, 2, 3], f="length"), index=0),
               dict(result_of(job_id, "xyé", [4, 5]), index=1)]
    return payloads, dict(result_of(job_id, "ABC", [1, 2, 3], f="length"), samples=samples)


def wide_ids_job(job_id):
    """Token ids of every width the record's string holds: 1 to 4 UTF-8 bytes, either side of the
    surrogates it skips, and past 65535 (a 150k vocabulary)."""
    ids = [5, 127, 128, 2047, 2048, 0xD7FF, 0xD800, 0xDFFF, 0xFFFF, 0x10000, 151_000]
    pieces = [(f" w{i}", [t]) for i, t in enumerate(ids)]
    deltas = stream_of(pieces, sd=2**63 + 12345)
    deltas[-1]["f"] = "length"
    return [[d] for d in deltas], result_of(job_id, "".join(p for p, _ in pieces), ids, f="length")


SCENARIOS = {"plain": plain_job, "chat": chat_job, "cut_call": cut_call_job, "samples": samples_job,
             "wide_ids": wide_ids_job}


@pytest.fixture
def rr(redis_url):
    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()


def leased(r, job_id) -> Queue:
    q = Queue(r, KEYS, fast_settings("redis://unused"))
    r.hset(KEYS.job(job_id), mapping={"status": "running", "owner": OWNER, "attempts": 1})
    return q


def pack_payload(p) -> bytes:
    """A payload as a worker sends it: a map, or a list of one step's samples' deltas (a list of
    one here stands for its map)."""
    return codec.pack(p if isinstance(p, dict) else (p[0] if len(p) == 1 else p))


def play(q: Queue, job_id, payloads, result, upto=None) -> None:
    """Write ``payloads`` as a worker does: every one but the last through deltas.lua, the last with
    the result through complete.lua; stop after ``upto`` payloads (the job runs on)."""
    if upto is not None:
        for seq, p in enumerate(payloads[:upto], 1):
            publish_deltas(q, [(job_id, OWNER, pack_payload(p), seq)])
        return
    play_rest(q, job_id, payloads, result, 0)


def play_rest(q, job_id, payloads, result, cut) -> None:
    """The payloads after the first ``cut``, then the completion."""
    for seq, p in enumerate(payloads[cut:-1], cut + 1):
        publish_deltas(q, [(job_id, OWNER, pack_payload(p), seq)])
    assert q.complete(job_id, OWNER, "done", as_record(result), pack_payload(payloads[-1])) == 1


def as_record(result: dict) -> bytes:
    """The result as a worker writes it (``Result.record``): token ids as a string, id left out."""
    return Result.model_validate(result).record()


def dumps(deltas) -> list[dict]:
    return [d.model_dump() for d in deltas]


def as_deltas(payloads) -> list[Delta]:
    return [Delta.from_wire(w) for p in payloads for w in (p if isinstance(p, list) else [p])]


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_finished_stream_is_compacted_and_expands_to_the_same_deltas(rr, name):
    job_id = f"{len(name):032x}"
    payloads, result = SCENARIOS[name](job_id)
    play(leased(rr, job_id), job_id, payloads, result)
    assert not rr.exists(KEYS.events(job_id))
    expanded = replay.expand(*rr.hmget(KEYS.job(job_id), replay.FIELD, "result"))
    assert expanded == [p if isinstance(p, list) else [p] for p in payloads]  # the wire maps, seed included
    assert not rr.hexists(KEYS.job(job_id), "sent")


@pytest.mark.parametrize("spoil", ["gap", "terminal", "text"])
def test_a_stream_the_record_could_not_replay_exactly_is_kept(rr, spoil):
    job_id = "b" * 32
    payloads, result = plain_job(job_id)
    q = leased(rr, job_id)
    if spoil == "gap":
        payloads[1][0]["n"] += 1
    elif spoil == "terminal":
        rr.xadd(KEYS.events(job_id), {"f": "cancelled"})
    else:
        result["text"] = result["text"].replace("était", "etait")
    play(q, job_id, payloads, result)
    assert rr.xlen(KEYS.events(job_id)) == len(payloads) + (spoil == "terminal")
    assert not rr.hexists(KEYS.job(job_id), replay.FIELD)


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("cut", [1, 2])
def test_a_reader_that_read_part_of_the_stream_resumes_after_the_compaction_with_exactly_the_rest(rr, name, cut):
    """The race, at the core: an XRANGE that came before the compaction, then the record after it."""
    job_id = f"{len(name) + 16 * cut:032x}"
    payloads, result = SCENARIOS[name](job_id)
    q = leased(rr, job_id)
    play(q, job_id, payloads, result, upto=cut)
    core = JobCore(job_id, KEYS, watch=None)  # (no waits: only its feeds)
    first = core.feed_record(rr.xrange(KEYS.events(job_id)))
    play_rest(q, job_id, payloads, result, cut)
    assert core.feed_record(rr.xrange(KEYS.events(job_id), min=core.replay_from())) == []  # gone
    rest = core.feed_replay(rr.hmget(KEYS.job(job_id), replay.FIELD, "result"))
    assert core.state.done
    assert dumps(first + rest) == dumps(as_deltas(payloads))


@pytest.mark.parametrize("name", SCENARIOS)
def test_clients_read_a_compacted_job_as_the_live_stream_and_resume_across_the_compaction(rr, redis_url, name):
    """Client and AsyncClient: one reads part of the stream, stops, and resumes after the job
    ended (its stream compacted: the rest comes from the record); a late one reads it all."""
    job_id = f"{len(name) + 100:032x}"
    payloads, result = SCENARIOS[name](job_id)
    q = leased(rr, job_id)
    expected = dumps(as_deltas(payloads))
    play(q, job_id, payloads, result, upto=2)
    with Client(redis_url, model="tiny") as c:
        job = c.job(job_id)
        stream = job.stream(timeout=10)
        part = [next(stream) for _ in range(2)]
        stream.close()  # left early: its link goes; a later stream() subscribes and replays
        play_rest(q, job_id, payloads, result, 2)
        assert dumps(part + list(job.stream(timeout=10))) == expected
        assert dumps(c.job(job_id).stream(timeout=10)) == expected

    async def late():
        async with AsyncClient(redis_url, model="tiny") as ac:
            return [d async for d in (await ac.job(job_id)).stream(timeout=10)]

    assert dumps(asyncio.run(late())) == expected


def job_bytes(r, job_id) -> int:
    keys = (KEYS.job(job_id), KEYS.events(job_id), KEYS.done(job_id))
    return sum(r.memory_usage(k, samples=0) or 0 for k in keys)


def test_a_finished_job_costs_at_most_2_kib_plus_its_text_and_a_late_subscriber_gets_the_live_deltas(
        tiny_model, redis_url, rr):
    """The real worker: 8- and 300-token jobs (n = 1 and n = 2); the bytes are MEMORY USAGE over the
    finished job's keys (deterministic for the content), against its text (its token ids count).
    One token a step (speculation off): a step that speculated gives a delta of several tokens, and the
    record keeps each such delta's sizes (300 tokens speculated at every step: a 710-byte record
    against 324; docs/PROTOCOL.md section 4), so whether the policy speculated would move the bytes."""
    settings = fast_settings(redis_url, speculate="off")
    with running_worker(tiny_model, redis_url, settings), Client(redis_url, model="tiny") as c:
        for tokens, n in ((8, 1), (300, 1), (8, 2)):
            job = c.submit("Once upon a time", max_tokens=tokens, ignore_eos=True, temperature=0.8, n=n)
            live = dumps(job.stream(timeout=120))
            res = job.result(timeout=30)
            assert not rr.exists(KEYS.events(job.id)) and rr.hexists(KEYS.job(job.id), replay.FIELD)
            assert dumps(c.job(job.id).stream(timeout=10)) == live
            outputs = res.outputs
            text = sum(len(o.text.encode()) for o in outputs)
            assert job_bytes(rr, job.id) <= BUDGET * n + text, (tokens, n, job_bytes(rr, job.id), text)


def test_a_late_subscriber_gets_the_live_deltas_of_real_tool_call_and_reasoning_jobs(tiny_model, redis_url, rr):
    """The real worker's chat deltas: a named tool call (its arguments streamed), then a job pushed
    into thinking (reasoning deltas), with logprobs: read live while they run, then late from the
    compacted record, by Client and AsyncClient."""
    from mlxq.devkit.make_model import THINK_START
    from toolcallkit import MESSAGES, TOOLS

    think = tiny_model.tokenizer.get_vocab()[THINK_START]
    with running_worker(tiny_model, redis_url), Client(redis_url, model="tiny") as c:
        jobs = [c.submit(messages=MESSAGES, tools=TOOLS, max_tokens=120, logprobs=2,
                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                         logit_bias={think: -100.0}),
                c.submit(messages=MESSAGES, max_tokens=24, logit_bias={think: 100.0}, temperature=0.7)]
        live = [dumps(j.stream(timeout=120)) for j in jobs]
        late = [dumps(c.job(j.id).stream(timeout=10)) for j in jobs]

    async def alate():
        async with AsyncClient(redis_url, model="tiny") as ac:
            return [[d.model_dump() async for d in (await ac.job(j.id)).stream(timeout=10)] for j in jobs]

    assert [rr.hexists(KEYS.job(j.id), replay.FIELD) and not rr.exists(KEYS.events(j.id)) for j in jobs] == [True] * 2
    assert any(d["tool_calls"] for d in live[0]) and any(d["partial_args"] for d in live[0])
    assert any(d["reasoning"] for d in live[1])
    assert late == live and asyncio.run(alate()) == live


def test_the_record_of_a_result_reads_back_as_the_same_result():
    """``Result.record``: no id (the key has it), no null field, no stats that follow from the others,
    token ids as a string; read back with the id, it is the result the worker had."""
    res = Result.model_validate({
        "id": "c" * 32, "text": "Ok", "token_ids": [7, 0xD800, 151_000], "finish_reason": "tool_calls",
        "tool_calls": [CALL], "logprobs": LP,
        "stats": {"queued_at": 10.0, "started_at": 10.5, "first_token_at": 11.0, "finished_at": 13.0,
                  "prompt_tokens": 40, "generated_tokens": 3, "attempts": 2, "tier": "low", "worker": "w", "seed": 9},
        "samples": [{"index": 0, "text": "Ok", "token_ids": [7, 0xD800, 151_000], "finish_reason": "tool_calls"},
                    {"index": 1, "text": "", "token_ids": [], "finish_reason": "stop"}]})
    assert (res.stats.queue_wait_s, res.stats.ttft_s, res.stats.prompt_tps, res.stats.generation_tps) == (
        0.5, 1.0, 80.0, 1.0)
    kept = codec.unpack(res.record())
    assert "id" not in kept and "error" not in kept and "queue_wait_s" not in kept["stats"]
    assert isinstance(kept["token_ids"], str) and len(kept["token_ids"]) == 3
    assert Result.model_validate({**kept, "id": res.id}) == res
