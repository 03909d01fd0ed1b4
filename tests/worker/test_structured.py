"""Structured output: constraints compiled before queueing, masks in the batch.

The tiny test model's weights are random-ish, so only the constraint makes its output valid: every
property here holds for any weights.  References (greedy tokens of a sequence alone in the engine, a job run
alone, an uncrashed run) are computed in the same run.  Engine-level tests drive a PagedEngine directly (first:
MLX runs on one thread at a time); then one in-process worker, started once, serves the queue tests;
the crash test runs worker subprocesses on a queue of their own.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
import redis
from mlx_lm.generate import generate_step

from mlxq import Client
from mlxq.shared import codec, constraints
from mlxq.shared.constraints import ConstraintError, compile_format
from mlxq.shared.keys import ModelKeys
from mlxq.shared.protocol import Queue
from mlxq.shared.schemas import GenerateRequest
from mlxq.worker.engine import PagedEngine
from mlxq.worker.engine.logit_shaping import RowGrammar
from mlxq.worker.engine.api import SeqSpec
from workerkit import fast_settings, running_worker
from faultkit import WorkerProc, reference_tokens, wait_registered

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham", "unsure"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "meta": {
            "type": "object",
            "properties": {"lang": {"enum": ["en", "fr", "de"]}, "urgent": {"type": "boolean"}},
            "required": ["lang", "urgent"],
            "additionalProperties": False,
        },
        # letters only: every character costs at most one token, so the worst path stays short
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "maxItems": 3},
        "points": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9},
                   "minItems": 1, "maxItems": 4},
    },
    "required": ["label", "score", "meta", "tags", "points"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "triage", "schema": SCHEMA, "strict": True}}
# the longest output the schema allows is ~130 bytes; even one token per byte ends well within this
SCHEMA_MAX_TOKENS = 200
REGEX = r"(yes|no|maybe)-[0-9]{2,4}"
CHOICES = ["alpha", "beta", "gamma delta", "épsilon"]
LONG_REGEX = "[a-z]{90}"  # long by construction: at least 9 tokens (the longest lowercase token is 10 letters)
# at least 100 tokens whatever the model says: its byte-level BPE has no token with a letter on both sides of a
# space, so each of the 100 letters starts a new token (at most 199 tokens: one a byte)
SPACED_REGEX = "[a-z]( [a-z]){99}"
PROMPTS = ["The weather today", "Once upon a time", "A list of fruit:", "Tell me about cats",
           "hello world", "The report says", "Numbers:", "In the morning"]
PENALTY = dict(presence_penalty=0.5, frequency_penalty=1.0)  # exact in float32: batched == reference
MODULE_KEYS = ModelKeys("tiny")


def _encode(loaded, text):
    return loaded.tokenizer.encode(text)


def _text_ids(loaded, ids):
    return [t for t in ids if t not in loaded.eos_token_ids]


# ================================================================ references (before the worker starts:
# MLX stays on one thread at a time)
def _penalized_reference(loaded, prompt_ids, max_tokens, presence, frequency):
    """mlx-lm's greedy decoding with OpenAI's penalties as a logits processor over generated tokens."""
    n_prompt = len(prompt_ids)

    def penalize(tokens, logits):
        gen = np.asarray(tokens.tolist()[n_prompt:], dtype=np.int64)
        if not len(gen):
            return logits
        counts = np.bincount(gen, minlength=logits.shape[-1])[:logits.shape[-1]]
        bias = np.zeros(logits.shape[-1], dtype=np.float32)
        bias -= (presence * (counts > 0) + frequency * counts).astype(np.float32)
        return logits + mx.array(bias)

    out = []
    for tok, _ in generate_step(mx.array(prompt_ids), loaded.model, max_tokens=max_tokens,
                                logits_processors=[penalize]):
        if int(tok) in loaded.eos_token_ids:
            break
        out.append(int(tok))
    return out


@pytest.fixture(scope="module")
def refs(tiny_model):
    free = {p: reference_tokens(tiny_model, _encode(tiny_model, p), 24) for p in PROMPTS[:4]}
    pen_prompt = PROMPTS[4]
    penalized = _penalized_reference(tiny_model, _encode(tiny_model, pen_prompt), 24, **{
        "presence": PENALTY["presence_penalty"], "frequency": PENALTY["frequency_penalty"]})
    return {"free": free, "penalized": (pen_prompt, penalized)}


@pytest.fixture(scope="module")
def served(tiny_model, redis_server, refs):
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    r.close()
    settings = fast_settings(redis_server.url)
    with running_worker(tiny_model, redis_server.url, settings, max_batch=16) as worker:
        client = Client(redis_server.url, model="tiny", settings=settings)
        try:
            yield client, worker
        finally:
            client.close()


# ================================================================ engine level: dead ends, preemption
class _Poisoned(RowGrammar):
    """A matcher driven into its error state after ``after`` tokens (a forbidden token fed to it):
    the next mask is empty, as a grammar that dead-ends."""

    def __init__(self, row: RowGrammar, after: int, forbidden: int):
        super().__init__(row.matcher)
        self.left, self.forbidden = after, forbidden
        if after == 0:
            self.matcher.consume_token(forbidden)

    def advance(self, token):
        refused = super().advance(token)
        self.left -= 1
        if self.left == 0:
            self.matcher.consume_token(self.forbidden)
        return refused


def _engine(loaded, **kw):
    return PagedEngine(loaded.model, eos_token_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer,
                       **{"num_blocks": 64, **kw})


def _drive(engine, specs, arrivals=None):
    """Run to the end; {uid: (tokens, finish, error)}; ``arrivals``: {step: [specs]} added later."""
    out: dict = {}
    engine.add(list(specs))
    step = 0
    while (engine.has_work() or any(k >= step for k in (arrivals or {}))) and step < 2000:
        engine.add((arrivals or {}).get(step, []))
        events, preempted = engine.step()
        assert not preempted
        for e in events:
            assert out.get(e.uid, (None, None))[1] is None, "event after the end"
            toks = out.get(e.uid, ([],))[0]
            if e.token is not None:
                toks.append(e.token)
            out[e.uid] = (toks, e.finish_reason, e.error)
        step += 1
    return out


@pytest.mark.parametrize("after", [0, 3], ids=["first-token", "mid-decode"])
def test_a_dead_end_ends_that_job_only(tiny_model, after):
    loaded = tiny_model
    eos = tuple(loaded.eos_token_ids)
    digit = _encode(loaded, "7")[-1]
    letters = compile_format({"type": "regex", "pattern": "[a-z]{12}"})
    doomed = compile_format({"type": "regex", "pattern": "[a-z]{13}"})
    engine = _engine(loaded)
    start = engine.scheduler.start_grammar
    engine.scheduler.start_grammar = lambda g, resume: (
        _Poisoned(start(g, resume), after, digit) if g == doomed else start(g, resume))
    free_prompt = _encode(loaded, PROMPTS[0])
    specs = [SeqSpec("free", free_prompt, 16, stop_token_ids=eos),
             SeqSpec("ok", _encode(loaded, PROMPTS[1]), 40, stop_token_ids=eos, grammar=letters),
             SeqSpec("dead", _encode(loaded, PROMPTS[2]), 40, stop_token_ids=eos, grammar=doomed)]
    out = _drive(engine, specs)
    toks, finish, error = out["dead"]
    assert finish == "error" and "constraint" in error and "\n" not in error and len(toks) == after
    free = out["free"][0]  # the engine emits the EOS that ends a row; the reference stops before it
    if free and free[-1] in eos:
        free = free[:-1]
    assert free == reference_tokens(loaded, free_prompt, 16)
    ok = loaded.tokenizer.decode(_text_ids(loaded, out["ok"][0]))
    assert out["ok"][1] == "stop" and re.fullmatch("[a-z]{12}", ok)
    assert engine.stats()["running"] == 0


def test_a_grammar_the_model_cannot_start_fails_at_add(tiny_model):
    engine = _engine(tiny_model)
    bad = json.dumps({"grammars": [{"lark_grammar": "start: <[999999]>"}]})  # no such token
    out = _drive(engine, [SeqSpec("x", _encode(tiny_model, "hi"), 4, grammar=bad),
                          SeqSpec("y", _encode(tiny_model, "hi"), 4)])
    assert out["x"][1] == "error" and out["x"][0] == [] and out["x"][2]
    assert out["y"][1] in ("stop", "length")


def test_a_grammar_library_failure_at_start_fails_that_job_only(tiny_model):
    """Whatever starting a constraint raises (not only a GrammarError: the library's own bug)
    ends that job with "error"; it raised out of the engine's add before, on the worker's MLX
    thread, and the worker stopped."""
    engine = _engine(tiny_model)
    engine.scheduler.start_grammar = lambda g, resume: {}["no such key"]
    grammar = compile_format({"type": "regex", "pattern": "[a-z]{4}"})
    prompt = _encode(tiny_model, "hi")
    out = _drive(engine, [SeqSpec("x", prompt, 4, grammar=grammar), SeqSpec("y", prompt, 4)])
    assert out["x"][1] == "error" and "no such key" in out["x"][2] and out["x"][0] == []
    assert out["y"][1] in ("stop", "length")


def test_an_engine_without_a_usable_tokenizer_fails_constrained_jobs_only(tiny_model):
    grammar = compile_format({"type": "regex", "pattern": "[a-z]{4}"})
    prompt = _encode(tiny_model, "hi")
    for tokenizer in (None, object()):  # none, and one llguidance cannot read
        engine = PagedEngine(tiny_model.model, num_blocks=16, eos_token_ids=tiny_model.eos_token_ids,
                             tokenizer=tokenizer)
        out = _drive(engine, [SeqSpec("x", prompt, 4, grammar=grammar), SeqSpec("y", prompt, 4)])
        assert out["x"][1] == "error" and "unavailable" in out["x"][2]
        assert out["y"][1] in ("stop", "length")


def test_preempted_constrained_job_resumes_exactly(tiny_model):
    loaded = tiny_model
    eos = tuple(loaded.eos_token_ids)
    grammar = compile_format({"type": "regex", "pattern": LONG_REGEX})
    prompt = _encode(loaded, PROMPTS[3])

    def job(**kw):
        return SeqSpec("x", prompt, 120, stop_token_ids=eos, grammar=grammar, priority=5.0, **kw)

    alone = _drive(_engine(loaded), [job()])["x"]
    engine = _engine(loaded, num_blocks=5, pressure=1.0)  # room for one sequence
    urgent = SeqSpec("u", [7] * 100, 3, priority=0.0, stop_token_ids=())
    got, step, preempted_at, finish = [], 0, None, None
    engine.add([job()])
    while engine.has_work() and step < 2000:
        if step == 8:
            engine.add([urgent])
        events, preempted = engine.step()
        for e in events:
            if e.uid == "x":
                got.append(e.token)
                finish = e.finish_reason
        for p in preempted:
            assert p.uid == "x" and p.tokens == got
            preempted_at = len(got)
            engine.add([job(resume_tokens=list(got))])  # (max_tokens is generous: unchanged)
        step += 1
    assert preempted_at and 0 < preempted_at < len(got)
    assert (got, finish) == (alone[0], alone[1]) and finish == "stop"
    assert re.fullmatch(LONG_REGEX, loaded.tokenizer.decode(_text_ids(loaded, got)))


# ================================================================ refused before queueing
BAD_FORMATS = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "florp"}}}, "florp"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}}}, "if"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "regex", "pattern": "(ab"}, "unclosed group"),
    ({"type": "regex", "pattern": "(?<=a)b"}, "look-around"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"type": "grammar", "grammar": "root ::= ( "}, "GBNF"),
    ({"type": "choice", "choices": []}, "choices"),
    ({"type": "xml"}, "type"),
    # keys a type does not take are refused, not ignored (the schema here constrained nothing)
    ({"type": "json_object", "schema": {"type": "object"}}, "json_schema"),
    ({"type": "text", "json_schema": {"name": "x", "schema": {}}}, "takes no"),
    ({"type": "regex", "pattern": "a+", "flags": "i"}, "flags"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": "true"}}, "strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "stric": True}}, "stric"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {"type": "object"}}}, "name"),
]


@pytest.mark.parametrize("fmt,words", BAD_FORMATS, ids=[str(i) for i in range(len(BAD_FORMATS))])
def test_bad_constraint_has_a_clear_one_line_error(fmt, words):
    with pytest.raises(ConstraintError) as err:
        compile_format(fmt)
    msg = str(err.value)
    assert words in msg and "\n" not in msg and msg.startswith("response_format")
    with pytest.raises(ValueError, match="response_format"):
        GenerateRequest(model="m", prompt="x", response_format=fmt)


def test_identical_constraints_compile_once():
    fmt = {"type": "regex", "pattern": "[0-9]{3}-cache-probe"}
    before = constraints._compiled.cache_info()
    for _ in range(2000):
        GenerateRequest(model="m", prompt="x", response_format=json.loads(json.dumps(fmt)))
    after = constraints._compiled.cache_info()
    assert after.misses - before.misses == 1 and after.hits - before.hits == 1999


def test_bad_constraints_never_reach_the_queue_and_the_worker_keeps_serving(served):
    client, _ = served
    for fmt, _ in BAD_FORMATS:
        with pytest.raises(ValueError, match="response_format"):
            client.submit("x", max_tokens=4, response_format=fmt)
    assert client.redis.zcard(MODULE_KEYS.queue) == 0
    # bypassing validation: a malformed constraint put straight into the queue fails that job only
    q = Queue(client.redis, MODULE_KEYS, client.settings)
    bad_id = "d" * 32
    q.enqueue(bad_id, codec.pack({"id": bad_id, "model": "tiny", "prompt": "x", "max_tokens": 4,
                                  "response_format": {"type": "regex", "pattern": "a(("}}),
              global_redis=client.redis)
    res = client.job(bad_id).result(timeout=60)
    assert res.finish_reason == "error" and "response_format" in res.error and res.error_code == "invalid_request"
    good = client.submit("still serving", max_tokens=6, response_format={"type": "regex", "pattern": "[a-z]{3}"})
    out = good.result(timeout=60)
    assert out.finish_reason == "stop" and re.fullmatch("[a-z]{3}", out.text)


# ================================================================ valid output, sampled
def test_64_sampled_schema_jobs_all_validate(served):
    client, _ = served
    rng = random.Random(19)
    jobs = [client.submit(PROMPTS[i % len(PROMPTS)], max_tokens=SCHEMA_MAX_TOKENS, response_format=JSON_FORMAT,
                          temperature=rng.choice([0.7, 1.0, 1.5]), top_p=rng.choice([1.0, 0.95]),
                          seed=1000 + i) for i in range(64)]
    results = [j.result(timeout=240) for j in jobs]
    for res in results:
        assert res.finish_reason == "stop", (res.finish_reason, res.error, res.text)
        jsonschema.validate(json.loads(res.text), SCHEMA)
    assert len({r.text for r in results}) > 1  # sampled: the constraint shapes, the seeds vary


def test_regex_and_choice_constraints_hold(served):
    client, _ = served
    regex_jobs = [client.submit(PROMPTS[i], max_tokens=40, temperature=1.0, seed=i,
                                response_format={"type": "regex", "pattern": REGEX}) for i in range(8)]
    choice_jobs = [client.submit(PROMPTS[i], max_tokens=40, temperature=1.2, seed=50 + i,
                                 response_format={"type": "choice", "choices": CHOICES}) for i in range(8)]
    for res in (j.result(timeout=120) for j in regex_jobs):
        assert res.finish_reason == "stop" and re.fullmatch(REGEX, res.text), res
    for res in (j.result(timeout=120) for j in choice_jobs):
        assert res.finish_reason == "stop" and res.text in CHOICES, res


def test_a_constraint_cut_by_max_tokens_finishes_length(served):
    client, _ = served
    res = client.submit("x", max_tokens=5, response_format={"type": "regex", "pattern": LONG_REGEX}).result(timeout=60)
    assert res.finish_reason == "length" and len(res.token_ids) == 5 and re.fullmatch("[a-z]+", res.text)


# ================================================================ mixed batches are exact
def test_mixed_batch_free_rows_equal_solo_and_constrained_rows_equal_alone(served, refs, tiny_model):
    client, _ = served
    free_prompts = list(refs["free"])
    constrained = [(PROMPTS[4], JSON_FORMAT), (PROMPTS[5], {"type": "regex", "pattern": REGEX}),
                   (PROMPTS[6], {"type": "choice", "choices": CHOICES}), (PROMPTS[7], JSON_FORMAT)]
    jobs = []
    for (cp, fmt), fp in zip(constrained, free_prompts):  # interleaved in one batch
        jobs.append(client.submit(fp, max_tokens=24))
        jobs.append(client.submit(cp, max_tokens=SCHEMA_MAX_TOKENS, response_format=fmt))
    results = [j.result(timeout=120) for j in jobs]
    for i, fp in enumerate(free_prompts):
        assert results[2 * i].token_ids == refs["free"][fp], fp
    for i, (cp, fmt) in enumerate(constrained):
        alone = client.submit(cp, max_tokens=SCHEMA_MAX_TOKENS, response_format=fmt).result(timeout=60)
        batched = results[2 * i + 1]
        assert batched.finish_reason == alone.finish_reason == "stop"
        assert batched.token_ids == alone.token_ids, cp


# ================================================================ penalties and logit_bias
def test_logit_bias_and_penalties(served, refs, tiny_model):
    client, _ = served
    target = _encode(tiny_model, "The weather")[-1]  # a token id of this vocabulary
    biased = client.submit("hello", max_tokens=8, ignore_eos=True, temperature=1.0, seed=3,
                           logit_bias={target: 100.0})
    # a penalized greedy job equals mlx-lm with the same penalties, alone and in a batch of others
    pen_prompt, pen_ref = refs["penalized"]
    alone = client.submit(pen_prompt, max_tokens=24, **PENALTY).result(timeout=60)
    crowd = [client.submit(p, max_tokens=24, temperature=0.8, seed=i) for i, p in enumerate(PROMPTS[:5])]
    batched = client.submit(pen_prompt, max_tokens=24, **PENALTY)
    assert biased.result(timeout=60).token_ids == [target] * 8
    assert alone.token_ids == pen_ref
    assert batched.result(timeout=60).token_ids == pen_ref
    for j in crowd:
        assert j.result(timeout=60).finish_reason in ("stop", "length")
    out_of_vocab = client.submit("x", max_tokens=2, logit_bias={10**6: 1.0}).result(timeout=60)
    assert out_of_vocab.finish_reason == "error" and "vocabulary" in out_of_vocab.error


# ================================================================ crash resume through the queue
def test_constrained_job_resumes_exactly_after_a_worker_crash(served, tiny_model_dir, redis_server, tmp_path):
    client, _ = served
    url = redis_server.url
    # long by construction (>= 100 tokens), so the job is still running when it has streamed 5 entries
    # (a worker that publishes late streams several steps an entry)
    fmt = {"type": "regex", "pattern": SPACED_REGEX}
    # the uncrashed run, on the module's worker
    ref = client.submit(PROMPTS[3], max_tokens=220, response_format=fmt).result(timeout=60)
    assert ref.finish_reason == "stop" and re.fullmatch(SPACED_REGEX, ref.text)
    lease = dict(lease_s=2, heartbeat_s=0.5)
    crash_client = Client(url, model="tinyc", settings=fast_settings(url, **lease))
    keys = ModelKeys("tinyc")
    a = WorkerProc(url, tiny_model_dir, tmp_path, name="tinyc", max_batch=4, **lease)
    b = None
    try:
        assert wait_registered(url, model="tinyc"), a.log()
        a.freeze()  # while the job goes in: it runs in slices from the first look
        job = crash_client.submit(PROMPTS[3], max_tokens=220, response_format=fmt)
        assert a.run_until(lambda: crash_client.redis.xlen(keys.events(job.id)) >= 5), a.log()
        at_kill = (job.status(), crash_client.redis.xlen(keys.events(job.id)))
        a.kill9()
        b = WorkerProc(url, tiny_model_dir, tmp_path, name="tinyc", max_batch=4, **lease)
        res = job.result(timeout=120)
        assert res.stats.attempts == 2, f"status and stream entries at the kill: {at_kill}\n{b.log()}"
        assert (res.finish_reason, res.token_ids, res.text) == ("stop", ref.token_ids, ref.text)
    finally:
        a.stop()
        if b:
            b.stop()
        crash_client.close()


# ================================================================ reasoning: the constraint after the thinking
def test_constraint_applies_after_the_reasoning_block(tiny_model):
    from mlxq.shared.constraints import ModelFormat, after_thinking
    from mlxq.worker.engine.logit_shaping import GrammarBook

    hf = tiny_model.tokenizer._tokenizer
    # two of the tiny model's special tokens stand in for a reasoning model's <think> and </think>
    start, end = hf.convert_tokens_to_ids("<|system|>"), hf.convert_tokens_to_ids("<|user|>")
    fmt = ModelFormat(think_start="<|system|>", think_end="<|user|>", think_start_ids=(start,), think_end_ids=(end,))
    grammar = compile_format(JSON_FORMAT)
    book = GrammarBook(tiny_model.tokenizer, tiny_model.eos_token_ids)
    answer = hf.encode('{"label":"ham","score":7,"meta":{"lang":"en","urgent":true},"tags":[],"points":[1]}',
                       add_special_tokens=False)
    thought = hf.encode('free text } { "not json', add_special_tokens=False)
    cases = [(fmt, [start] + thought + [end] + answer, True), (fmt, answer, True),
             (ModelFormat(**{**fmt.__dict__, "in_thinking": True}), thought + [end] + answer, True),
             (fmt, thought, False)]  # free text outside a reasoning block is refused
    for f, tokens, ok in cases:
        row = book.start(after_thinking(grammar, f), [])
        assert row.matcher.consume_tokens(tokens) == ok
        assert row.matcher.is_accepting() == ok


def test_output_follows_the_schema_property_order(served):
    client, _ = served
    res = client.submit("x", max_tokens=SCHEMA_MAX_TOKENS, response_format=JSON_FORMAT).result(timeout=60)
    assert list(json.loads(res.text)) == list(SCHEMA["properties"])


def test_seeds_and_the_prefix_cache_keep_working_for_constrained_jobs(served):
    client, _ = served
    long_prompt = " ".join(PROMPTS * 3)  # several KV blocks: a second run finds them cached
    seeded = dict(max_tokens=SCHEMA_MAX_TOKENS, response_format=JSON_FORMAT, temperature=1.0, seed=77)
    alone = client.submit(long_prompt, **seeded).result(timeout=60)
    crowd = [client.submit(p, max_tokens=SCHEMA_MAX_TOKENS, response_format=JSON_FORMAT, temperature=1.0, seed=i)
             for i, p in enumerate(PROMPTS)]
    again = client.submit(long_prompt, **seeded)
    for j in crowd:
        jsonschema.validate(json.loads(j.result(timeout=60).text), SCHEMA)
    again = again.result(timeout=60)
    assert again.token_ids == alone.token_ids and again.finish_reason == "stop"
    assert again.usage.cached_tokens > 0



def test_strict_schema_closes_its_objects(tiny_model):
    """``strict: true`` (what a pydantic class is sent as) means no keys the schema does not list,
    as in OpenAI's strict mode; without it a JSON Schema allows them."""
    from mlxq.worker.engine.logit_shaping import GrammarBook

    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "object", "properties": {"c": {"type": "integer"}}}}}
    hf = tiny_model.tokenizer._tokenizer
    book = GrammarBook(tiny_model.tokenizer, tiny_model.eos_token_ids)
    extra_inner = hf.encode('{"a":1,"b":{"c":2,"x":3}}', add_special_tokens=False)
    for strict, accepted in ((False, True), (True, False)):
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": strict}}
        row = book.start(compile_format(fmt), [])
        assert (row.matcher.consume_tokens(extra_inner) and row.matcher.is_accepting()) == accepted
    assert constraints.closed(schema)["properties"]["b"]["additionalProperties"] is False
    # values are not schemas: a const, an enum, a default stay what they say; a property named like
    # one of those keywords is a schema all the same
    data = {"type": "object", "properties": {
        "kind": {"const": {"type": "object"}}, "opts": {"enum": [{"properties": {}}]},
        "cfg": {"type": "object", "default": {"type": "object"}},
        "const": {"type": "object", "properties": {"d": {"type": "integer"}}}}}
    c = constraints.closed(data)["properties"]
    assert c["kind"] == {"const": {"type": "object"}} and c["opts"] == {"enum": [{"properties": {}}]}
    assert c["cfg"]["default"] == {"type": "object"} and c["cfg"]["additionalProperties"] is False
    assert c["const"]["additionalProperties"] is False
