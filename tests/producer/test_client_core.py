"""One client core, tested once for both clients: every test here runs against ``Client`` and
``AsyncClient`` (the ``side`` fixture) with the same assertions, and the error tests compare the two
directly (same types, same messages).  Real Valkey, the real worker."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pydantic
import pytest
import redis

from mlxq import AsyncClient, Client, JobTimeout, NoModelError
from mlxq.producer.core import ParsedResult, prepare, schema_format, with_parsed
from mlxq.shared import apikeys, codec
from mlxq.shared.acl import producer_rules
from mlxq.shared.keys import GlobalKeys
from mlxq.shared.protocol import FunctionsNotLoaded, load_functions
from mlxq.shared.schemas import Result

from workerkit import fast_settings, running_worker, wait_for


class SyncSide:
    """A ``Client``; each call returns a concurrent Future (run on a thread)."""

    kind = "sync"

    def __init__(self, url: str, **kw):
        self.client = Client(url, **kw)
        self._pool = concurrent.futures.ThreadPoolExecutor(4)

    def start(self, fn, *args, **kw) -> concurrent.futures.Future:
        return self._pool.submit(fn, *args, **kw)

    def call(self, name: str, *args, **kw):
        return self.start(getattr(self.client, name), *args, **kw).result(timeout=120)

    def result(self, job, timeout=None) -> concurrent.futures.Future:
        return self.start(job.result, timeout=timeout)

    def stream(self, job, timeout=None) -> concurrent.futures.Future:
        return self.start(lambda: list(job.stream(timeout=timeout)))

    def close(self) -> None:
        self._pool.shutdown()
        self.client.close()


class AsyncSide(SyncSide):
    """An ``AsyncClient`` on an event loop of its own thread; each call returns a concurrent Future."""

    kind = "async"

    def __init__(self, url: str, **kw):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.client = asyncio.run_coroutine_threadsafe(self._make(url, kw), self.loop).result(timeout=60)

    @staticmethod
    async def _make(url, kw) -> AsyncClient:
        return AsyncClient(url, **kw)

    def start(self, fn, *args, **kw) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(fn(*args, **kw), self.loop)

    def stream(self, job, timeout=None) -> concurrent.futures.Future:
        async def collect():
            return [d async for d in job.stream(timeout=timeout)]
        return self.start(collect)

    def close(self) -> None:
        self.start(self.client.aclose).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


SIDES = {"sync": SyncSide, "async": AsyncSide}


@pytest.fixture(params=sorted(SIDES))
def side(request, redis_url):
    s = SIDES[request.param](redis_url, model="tiny", settings=fast_settings(redis_url))
    yield s
    s.close()


@pytest.fixture
def both(redis_url):
    sides = [SIDES[k](redis_url, model="tiny", settings=fast_settings(redis_url)) for k in sorted(SIDES)]
    yield sides
    for s in sides:
        s.close()


def raised(fn) -> BaseException:
    try:
        fn()
    except Exception as exc:
        return exc
    raise AssertionError("no exception raised")


def register_model(url: str, name: str, **info) -> None:
    r = redis.Redis.from_url(url)
    r.hset(GlobalKeys().models, name, codec.pack({"vocab_size": 64, "context_length": 64, **info}))
    r.close()


@pytest.fixture
def ghost(redis_url):
    """Model "ghost" in the registry (seen for years to come), served by no worker; its keys."""
    import time

    register_model(redis_url, "ghost", seen_at=time.time() + 10 * 365 * 86400)
    yield GlobalKeys().model_keys("ghost")
    r = redis.Redis.from_url(redis_url)
    r.hdel(GlobalKeys().models, "ghost")
    r.close()


def stored_request(url: str, job) -> dict:
    r = redis.Redis.from_url(url)
    try:
        return codec.unpack(r.hget(GlobalKeys().model_keys("tiny").job(job.id), "req"))
    finally:
        r.close()


# -- the same errors, from both ---------------------------------------------------------------------

BAD_SUBMISSIONS = {
    "no input": dict(),
    "two inputs": dict(prompt="a", prompt_tokens=[1]),
    "empty prompt": dict(prompt=""),
    "our id": dict(prompt="a", id="0" * 32),
    "bad temperature": dict(prompt="a", temperature=-1),
    "bad logit_bias": dict(prompt="a", logit_bias={"-3": 1.0}),
    "unknown model": dict(prompt="a", model="nope"),
    "too long for the context": dict(prompt_tokens=[1] * 100),
    "an id outside the vocabulary": dict(prompt_tokens=[1000]),
}


@pytest.mark.parametrize("case", sorted(BAD_SUBMISSIONS))
def test_bad_request_same_error_from_both(both, redis_url, case):
    register_model(redis_url, "tiny")
    errors = [raised(lambda s=s: s.call("submit", **BAD_SUBMISSIONS[case])) for s in both]
    assert isinstance(errors[0], (ValueError, NoModelError)), errors[0]
    assert type(errors[0]) is type(errors[1])
    assert what(errors[0]) == what(errors[1])


def what(exc: BaseException):
    """An error's message; a pydantic error's items without their input (it holds submitted_at)."""
    if isinstance(exc, pydantic.ValidationError):
        return [(e["type"], e["loc"], e["msg"]) for e in exc.errors()]
    return str(exc)


def test_functions_not_loaded_same_error_from_both(redis_url):
    """A producer under the ACL recipe (FCALL only) before any worker loaded mlxq's functions."""
    admin = redis.Redis.from_url(redis_url)
    loaded = bool(admin.function_list())  # (FLUSHALL keeps them: an earlier test's worker loaded them)
    admin.function_flush()
    admin.hset(GlobalKeys().models, "tiny", b"")
    apikeys.sync_model(admin, admin, GlobalKeys(), "tiny")
    admin.execute_command("ACL", "SETUSER", "producer", *producer_rules("producer-pw"))
    purl = redis_url.replace("redis://", "redis://producer:producer-pw@", 1)
    sides = [SIDES[k](purl, model="tiny", settings=fast_settings(purl)) for k in sorted(SIDES)]
    try:
        errors = [raised(lambda s=s: s.call("submit", prompt="hi", max_tokens=2)) for s in sides]
    finally:
        for s in sides:
            s.close()
        admin.execute_command("ACL", "DELUSER", "producer")
        if loaded:
            load_functions(admin)  # as the test found them
        admin.close()
    assert isinstance(errors[0], FunctionsNotLoaded), errors
    assert [(type(e), str(e)) for e in errors[0:1]] == [(type(e), str(e)) for e in errors[1:]]


def test_timeout_same_error_from_both(both):
    """No worker: the job stays queued; result() and stream() end at their timeout with JobTimeout."""
    for wait in ("result", "stream"):
        errors = []
        for s in both:
            job = s.call("submit", prompt="hello", max_tokens=4)
            exc = raised(lambda: getattr(s, wait)(job, timeout=0.3).result(timeout=60))
            errors.append((type(exc), str(exc).replace(job.id, "<id>")))
        assert errors[0][0] is JobTimeout, errors
        assert errors[0] == errors[1], errors


# -- the same behaviour ----------------------------------------------------------------------------

def test_params_pass_through_to_the_request(side, redis_url):
    """tools, tool_choice, parallel_tool_calls, the penalties and logit_bias reach the stored request."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    job = side.call("submit", messages=[{"role": "user", "content": "hi"}], tools=[tool], tool_choice="required", parallel_tool_calls=False,
                    presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={3: 2.0}, max_tokens=2)
    req = stored_request(redis_url, job)
    assert req["tools"][0]["function"]["name"] == "get_weather"
    assert req["tool_choice"] == "required"
    assert req["parallel_tool_calls"] is False
    assert (req["presence_penalty"], req["frequency_penalty"]) == (0.5, -0.25)
    assert {int(k): v for k, v in req["logit_bias"].items()} == {3: 2.0}


class Weather(pydantic.BaseModel):
    city: str
    degrees: int


def test_response_format_class_becomes_its_schema(side, redis_url):
    job = side.call("submit", prompt="hi", response_format=Weather, max_tokens=2)
    assert stored_request(redis_url, job)["response_format"] == schema_format(Weather)
    assert schema_format(Weather)["json_schema"]["schema"]["required"] == ["city", "degrees"]
    raw = {"type": "json_object"}
    job = side.call("submit", prompt="hi", response_format=raw, max_tokens=2)
    assert stored_request(redis_url, job)["response_format"] == raw


def test_result_survives_a_reconnect(side, redis_url, tiny_model):
    """The client's connection is killed while result() waits on the done list (no worker yet);
    result() reconnects, and the job's result arrives once a worker runs it."""
    job = side.call("submit", prompt="once upon a time", max_tokens=8, ignore_eos=True)
    fut = side.result(job, timeout=120)
    admin = redis.Redis.from_url(redis_url)
    try:
        assert wait_for(lambda: any(c.get("cmd") == "blpop" for c in admin.client_list()), timeout=60)
        assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
        assert not fut.done()
        with running_worker(tiny_model, redis_url):
            res = fut.result(timeout=120)
    finally:
        admin.close()
    assert res.finish_reason == "length" and len(res.token_ids) == 8 and res.error is None


def test_stream_then_result_agree(side, redis_url, tiny_model):
    with running_worker(tiny_model, redis_url):
        job = side.call("submit", prompt="once upon a time", max_tokens=12, ignore_eos=True)
        deltas = side.stream(job, timeout=120).result(timeout=150)
        res = side.result(job, timeout=120).result(timeout=150)
    assert [t for d in deltas for t in d.token_ids] == res.token_ids
    assert "".join(d.text for d in deltas) == res.text
    assert deltas[-1].finish_reason == res.finish_reason == "length"


def test_structured_result_is_parsed_or_says_why(side, redis_url, tiny_model):
    """For any weights: a job submitted with a pydantic class has exactly one of parsed / parse_error."""
    with running_worker(tiny_model, redis_url):
        job = side.call("submit", prompt="weather:", response_format=Weather, max_tokens=16)
        res = side.result(job, timeout=120).result(timeout=150)
    assert isinstance(res, ParsedResult)
    assert (res.parsed is None) != (res.parse_error is None)
    if res.parsed is not None:
        assert res.parsed == Weather.model_validate_json(res.text)
    again = side.result(side.call("job", job.id, response_format=Weather), timeout=60).result(timeout=90)
    assert (again.text, again.parsed, again.parse_error) == (res.text, res.parsed, res.parse_error)


# -- the core's pure parts ---------------------------------------------------------------------------

def test_with_parsed():
    ok = with_parsed(Result(id="x", text='{"city": "Oslo", "degrees": 3}', finish_reason="stop"), Weather)
    assert ok.parsed == Weather(city="Oslo", degrees=3) and ok.parse_error is None
    bad = with_parsed(Result(id="x", text='{"city": "Oslo"', finish_reason="length"), Weather)
    assert bad.parsed is None and "Weather" in bad.parse_error
    failed = with_parsed(Result(id="x", finish_reason="error", error="boom"), Weather)
    assert failed.parsed is None and "boom" in failed.parse_error
    assert "parsed" not in ok.model_dump() and "_parsed" not in ok.model_dump_json()
    plain = Result(id="x", text="hi", finish_reason="stop")
    assert with_parsed(plain, None) is plain


def test_prepare_leaves_dict_formats_alone():
    prep = prepare("tiny", {"prompt": "a", "response_format": {"type": "json_object"}}, None, 1 << 20)
    assert prep.schema is None and prep.request.response_format == {"type": "json_object"}
    prep = prepare("tiny", {"prompt": "a", "response_format": Weather}, None, 1 << 20)
    assert prep.schema is Weather and prep.request.response_format == schema_format(Weather)
    with pytest.raises(ValueError, match="byte limit"):
        prepare("tiny", {"prompt": "a" * 100}, None, 50)


def first_delta(side, job):
    """The first delta of a new stream() of ``job``, the stream then left (closed)."""
    if side.kind == "sync":
        def first():
            deltas = job.stream(timeout=30)
            try:
                return next(deltas)
            finally:
                deltas.close()
    else:
        async def first():
            deltas = job.stream(timeout=30)
            try:
                return await deltas.__anext__()
            finally:
                await deltas.aclose()
    return side.start(first).result(timeout=60)


def test_a_stream_left_early_unsubscribes_and_the_next_one_goes_on(side, redis_url):
    """A caller that leaves a stream before its end (a break, or the gateway ending an SSE when one
    of n samples fails) unsubscribes the job's channel: it stayed subscribed for as long as the
    client lived. The next stream() subscribes again and goes on where the last one stopped, each
    delta once. No worker serves "ghost": the test writes the job's durable record itself."""
    import time

    from mlxq.shared.schemas import Delta

    register_model(redis_url, "ghost", seen_at=time.time() + 10 * 365 * 86400)
    keys = GlobalKeys().model_keys("ghost")
    r = redis.Redis.from_url(redis_url)
    try:
        job = side.call("submit", prompt="a", model="ghost", max_tokens=4)
        chan = keys.channel(job.id)

        def subscribers() -> int:
            return r.pubsub_numsub(chan)[0][1]

        def write(d: Delta) -> None:
            r.xadd(keys.events(job.id), {"d": codec.pack(d.to_wire())})

        assert subscribers() == 1  # subscribed before the job was queued
        write(Delta(seq=1, text="a", token_ids=[5]))
        assert first_delta(side, job).text == "a"
        assert wait_for(lambda: subscribers() == 0, timeout=10)
        write(Delta(seq=2, index=1, offset=1, text="b", token_ids=[6], finish_reason="stop"))
        rest = side.stream(job, timeout=30).result(timeout=60)
        assert "".join(d.text for d in rest) == "b" and rest[-1].finish_reason == "stop"
        assert subscribers() == 0
    finally:
        r.hdel(GlobalKeys().models, "ghost")
        r.close()


def test_a_stream_left_mid_batch_keeps_the_rest_for_the_next_stream(side, redis_url):
    """A record read hands several deltas at once (a late reader, a gap, a quiet spell); a caller that
    takes one and leaves kept the stream state past all of them, so the next stream() started after
    them: the rest of the text and the final delta were lost, and that stream waited for an end it had
    already passed. Now they wait for the next stream(), each once, in order. No worker serves "ghost":
    the test writes the job's durable record itself."""
    import time

    from mlxq.shared.schemas import Delta

    register_model(redis_url, "ghost", seen_at=time.time() + 10 * 365 * 86400)
    keys = GlobalKeys().model_keys("ghost")
    r = redis.Redis.from_url(redis_url)
    try:
        job = side.call("submit", prompt="a", model="ghost", max_tokens=8, subscribe=False)
        for i, ch in enumerate("abcde"):
            r.xadd(keys.events(job.id), {"d": codec.pack(Delta(seq=i + 1, index=i, offset=i, text=ch,
                                                                 token_ids=[5 + i]).to_wire())})
        r.xadd(keys.events(job.id), {"d": codec.pack(Delta(seq=6, index=5, offset=5, text="",
                                                             finish_reason="stop").to_wire())})
        assert first_delta(side, job).text == "a"
        rest = side.stream(job, timeout=30).result(timeout=60)
        assert [d.text for d in rest] == ["b", "c", "d", "e", ""] and rest[-1].finish_reason == "stop"
    finally:
        r.hdel(GlobalKeys().models, "ghost")
        r.close()


def test_a_live_delta_of_one_sample_survives_a_failed_read_after_a_gap_in_another(redis_url, monkeypatch):
    """n = 2: a live payload carries sample 0's next delta and shows a gap in sample 1 (its previous
    message never came); the record read that follows fails once (a lost link). Sample 0's delta was
    fed (the state past it) and then dropped with the failed read: its text never reached the caller.
    The test writes the job's durable record and messages itself; no worker serves "ghost"."""
    import time

    from mlxq.producer.client import Job
    from mlxq.shared.schemas import Delta

    register_model(redis_url, "ghost", seen_at=time.time() + 10 * 365 * 86400)
    keys = GlobalKeys().model_keys("ghost")
    r = redis.Redis.from_url(redis_url)
    client = Client(redis_url, model="ghost")

    def d(sample, i, text, **kw):
        return Delta(seq=i + 1, index=i, offset=i, text=text, token_ids=[5] if text else [], sample=sample,
                     **kw).to_wire()

    def write(payload, publish=True):
        data = codec.pack(payload)
        r.xadd(keys.events(job.id), {"d": data})
        if publish:
            r.publish(keys.channel(job.id), data)

    try:
        job = client.submit(prompt="a", model="ghost", max_tokens=4, n=2)
        write([d(0, 0, "A"), d(1, 0, "a")])
        write(d(1, 1, "b"), publish=False)  # a live message that never came: a gap in sample 1
        write([d(0, 1, "B"), d(1, 2, "c")])
        write([d(0, 2, "", finish_reason="stop", n_samples=2), d(1, 3, "", finish_reason="stop", n_samples=2)])
        real, failed = Job._io_read_events, []

        def flaky(self, op):
            if not failed:
                failed.append(1)
                raise redis.ConnectionError("link lost (forced, once)")
            return real(self, op)

        monkeypatch.setattr(Job, "_io_read_events", flaky)
        got = {0: "", 1: ""}
        for delta in job.stream(timeout=30):
            got[delta.sample] += delta.text
        assert got == {0: "AB", 1: "abc"} and failed
    finally:
        client.close()
        r.hdel(GlobalKeys().models, "ghost")
        r.close()


def test_a_job_with_no_record_raises_job_not_found(side, redis_url):
    """A handle on an id no producer submitted, or on a job whose record expired, waited for ever
    (result(timeout=None)) or timed out as if the job were slow: an empty record was "not finished
    yet". Now result() and stream() raise JobNotFound, a LookupError."""
    from mlxq import JobNotFound

    unknown = "0" * 32
    job = side.call("job", unknown) if side.kind == "sync" else side.start(side.client.job, unknown).result(60)
    for wait in (side.result(job), side.stream(job)):
        err = wait.exception(timeout=60)
        assert isinstance(err, JobNotFound) and isinstance(err, LookupError) and unknown in str(err)


def test_the_async_client_leaves_no_subscription_behind_a_cancelled_submit_or_a_dropped_job(redis_url):
    """A submit cancelled while it enqueues (a gateway client gone mid-request: the handler's task is
    cancelled) kept the channel it had subscribed (``except Exception`` does not see the cancel); an
    AsyncJob dropped without stream() or result() (fire and forget, status() polled) kept its
    subscription and an inbox that filled with every delta for the client's lifetime. Now the
    cancelled submit unsubscribes, and a dropped job's inbox goes at once, its server subscription at
    the client's next submit. No worker serves "ghost"."""
    import gc
    import time

    register_model(redis_url, "ghost", seen_at=time.time() + 10 * 365 * 86400)
    r = redis.Redis.from_url(redis_url)

    async def run():
        client = AsyncClient(redis_url, model="ghost", settings=fast_settings(redis_url))
        real, entered = client._enqueue, asyncio.Event()

        async def stuck(*a, **kw):
            entered.set()
            await asyncio.Event().wait()  # a Redis call that does not come back
            return await real(*a, **kw)

        client._enqueue = stuck
        task = asyncio.ensure_future(client.submit(prompt="a", max_tokens=2))
        await entered.wait()
        assert len(client.subscriber._inboxes) == 1  # subscribed before the enqueue
        [chan] = list(client.subscriber._inboxes)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        cancelled = (len(client.subscriber._inboxes), r.pubsub_numsub(chan)[0][1])
        client._enqueue = real
        job = await client.submit(prompt="a", max_tokens=2)
        dropped = GlobalKeys().model_keys("ghost").channel(job.id)
        del job
        gc.collect()
        inbox_after_drop = len(client.subscriber._inboxes)
        await client.submit(prompt="b", max_tokens=2, subscribe=False)  # the next submit unsubscribes it
        server_after = r.pubsub_numsub(dropped)[0][1]
        await client.aclose()
        return cancelled, inbox_after_drop, server_after

    try:
        cancelled, inbox_after_drop, server_after = asyncio.run(run())
    finally:
        r.hdel(GlobalKeys().models, "ghost")
        r.close()
    assert cancelled == (0, 0) and inbox_after_drop == 0 and server_after == 0


def test_an_unconfirmed_subscription_is_a_pause_for_the_async_client_as_for_the_sync_one(redis_url, ghost,
                                                                                        monkeypatch):
    """A subscription the server does not confirm in time (here its confirmations are dropped): the
    async subscriber raised a bare TimeoutError, with no message, which the client did not take for
    a pause, so submit() failed at once; the sync one raises redis.TimeoutError, a pause retried for
    redis_outage_s. Now both do the same: retried, then RedisUnreachable naming the nodes tried."""
    from mlxq.producer import core
    from mlxq.shared.connection import RedisUnreachable

    real_route = core.Inboxes.route

    def route(self, reader, msg):
        if msg["type"] in ("subscribe", "ssubscribe"):
            return None  # the confirmation is lost
        return real_route(self, reader, msg)

    monkeypatch.setattr(core.Inboxes, "route", route)

    async def run():
        client = AsyncClient(redis_url, model="ghost", settings=fast_settings(redis_url, redis_outage_s=1.0))
        client.subscriber.confirm_timeout = 0.2
        try:
            with pytest.raises(RedisUnreachable):
                await client.submit(prompt="a", max_tokens=2)
        finally:
            await client.aclose()

    asyncio.run(run())


def test_a_long_prompt_is_prepared_off_the_event_loop(redis_url, ghost):
    """AsyncClient.submit validates, packs and (the gateway) tokenizes a long prompt on a worker thread:
    on the loop, a few MiB took seconds in which every other request and stream of the loop stood
    still. Here the prompt's token counter returns only once the loop has run a task of its own, which
    it can do only if the counter is not running on it."""
    from mlxq.producer.aclient import OFF_LOOP_CHARS

    loop_ran = threading.Event()
    counted = []

    def count(text: str) -> int:
        loop.call_soon_threadsafe(loop_ran.set)  # runs only when the loop is free to run it
        counted.append(loop_ran.wait(30))  # False after 30 s: the loop was blocked by this very call
        return 5

    async def run():
        nonlocal loop
        loop = asyncio.get_running_loop()
        async with AsyncClient(redis_url, model="ghost") as c:
            job = await c.submit(prompt="x" * (OFF_LOOP_CHARS + 1), max_tokens=4, _count_tokens=count)
            await job.cancel()

    loop = None
    asyncio.run(run())
    assert counted == [True]


# -- a job's waits end: the client closed, Redis gone, a short timeout -------------------------------

def close_client(side) -> None:
    if side.kind == "sync":
        side.client.close()
    else:
        side.start(side.client.aclose).result(timeout=60)


def test_closing_the_client_ends_every_wait_with_client_closed(side, redis_url, ghost):
    """A thread (a task) waits on a job's result and another on its stream when the client is
    closed: the result's wait raised a raw ValueError ("I/O operation on closed file") from inside
    redis-py, and the stream's waited for ever. Now both raise ClientClosed (a RuntimeError) saying
    so, and so does a wait begun after the close. No worker serves "ghost": the job stays queued."""
    from mlxq import ClientClosed

    r = redis.Redis.from_url(redis_url)
    try:
        job = side.call("submit", prompt="a", model="ghost", max_tokens=4, subscribe=False)
        other = side.call("job", job.id, "ghost") if side.kind == "sync" else \
            side.start(side.client.job, job.id, "ghost").result(60)
        waits = [side.result(job), side.stream(other)]
        assert wait_for(lambda: any(c.get("cmd") == "blpop" for c in r.client_list()), timeout=60)
        assert wait_for(lambda: r.pubsub_numsub(ghost.channel(job.id))[0][1] == 1, timeout=60)
        close_client(side)
        errors = [w.exception(timeout=60) for w in waits] + [side.result(job).exception(timeout=60)]
    finally:
        r.close()
    for err in errors:
        assert isinstance(err, ClientClosed) and isinstance(err, RuntimeError), repr(err)
        assert "closed" in str(err) and job.id in str(err)


@pytest.mark.parametrize("kind", sorted(SIDES))
def test_a_wait_with_no_timeout_gives_up_once_redis_stayed_down_past_the_outage_limit(kind):
    """Redis stopped for good while a result() and a stream() wait with timeout=None: they waited
    for ever (the client's link watch had no give-up). Now, once the links have been down for
    redis_outage_s, both raise RedisUnreachable, a redis.ConnectionError naming the node."""
    import time

    from mlxq.shared.connection import RedisUnreachable
    from mlxq.shared.embedded import EmbeddedRedis

    srv = EmbeddedRedis().start()
    try:
        register_model(srv.url, "ghost", seen_at=time.time() + 10 * 365 * 86400)
        side = SIDES[kind](srv.url, model="ghost", settings=fast_settings(srv.url, redis_outage_s=1.0))
        job = side.call("submit", prompt="a", max_tokens=4)
        other = side.call("job", job.id) if kind == "sync" else side.start(side.client.job, job.id).result(60)
    except BaseException:
        srv.stop()
        raise
    srv.stop()
    try:
        errors = [side.result(other).exception(timeout=120), side.stream(job).exception(timeout=120)]
    finally:
        side.close()
    for err in errors:
        assert isinstance(err, RedisUnreachable) and isinstance(err, redis.ConnectionError), repr(err)
        assert str(srv.port) in str(err)


def test_a_timeout_shorter_than_the_inner_waits_is_honoured(side, redis_url, ghost, monkeypatch):
    """result(timeout=0.2) and stream(timeout=0.2) on a job that cannot start (no worker serves
    "ghost"): stream() waited on its inbox a whole WAIT_S (and, subscribing, up to the 10 s
    confirmation) before it looked at its deadline. Now every inner wait ends at the deadline:
    both raise JobTimeout well before WAIT_S (made 60 s here, so that a busy machine's slowness is
    never mistaken for the wait), subscribed at submit or not."""
    import time

    from mlxq.producer import core

    monkeypatch.setattr(core, "WAIT_S", 60.0)
    for subscribe in (True, False):
        job = side.call("submit", prompt="a", model="ghost", max_tokens=4, subscribe=subscribe)
        for wait in (side.result, side.stream):
            t0 = time.monotonic()
            err = wait(job, timeout=0.2).exception(timeout=120)
            took = time.monotonic() - t0
            assert isinstance(err, JobTimeout), repr(err)
            assert took < 30, (wait.__name__, subscribe, took)


def test_every_handle_on_a_job_gets_every_delta_once(side, redis_url, ghost):
    """Three handles on one job (the submit's, and two from job(id)): the client kept one inbox per
    channel, so the last handle to subscribe took the live deltas from the others, and the first to
    leave unsubscribed the channel under them. Now each handle has its own inbox and the channel stays
    subscribed while any handle is on it: a handle that leaves after its first delta takes nothing
    from the two that stay, which each get every delta once. The deltas after the first are only
    published (not in the durable record), so a handle gets them live or never. No worker serves
    "ghost": the test writes the job's record and messages itself."""
    from mlxq.shared.schemas import Delta

    r = redis.Redis.from_url(redis_url)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        first = side.call("submit", prompt="a", model="ghost", max_tokens=4)
        if side.kind == "sync":
            second, leaver = side.call("job", first.id, "ghost"), side.call("job", first.id, "ghost")
        else:
            second, leaver = (side.start(side.client.job, first.id, "ghost").result(60) for _ in range(2))
        streams = [side.stream(first, timeout=60), side.stream(second, timeout=60)]
        left = pool.submit(first_delta, side, leaver)
        assert wait_for(lambda: second._pubsub is not None and leaver._pubsub is not None, timeout=60)

        def send(i, text, record=False, **kw):
            data = codec.pack(Delta(seq=i + 1, index=i, offset=i, text=text, token_ids=[5 + i], **kw).to_wire())
            if record:
                r.xadd(ghost.events(first.id), {"d": data})
            r.publish(ghost.channel(first.id), data)

        send(0, "a", record=True)
        assert left.result(timeout=60).text == "a"  # and that handle left: its stream is closed
        send(1, "b")
        send(2, "c", finish_reason="stop")
        got = [[d.text for d in s.result(timeout=90)] for s in streams]
    finally:
        pool.shutdown()
        r.close()
    assert got == [["a", "b", "c"]] * 2


def test_the_give_up_counts_only_the_outage_under_way_and_spares_timed_waits(monkeypatch):
    """The clients' give-up (redis_outage_s) ends a wait with no timeout. It counted from a failure long
    over: a client whose last call failed, then idle for an hour while Redis worked, gave up at the
    first error of the next blip. And it cut waits that had a timeout of their own (an rq-bridged
    job's result(timeout=3600) failed on a 31 s restart)."""
    from mlxq.shared import linkwatch
    from mlxq.shared.connection import RedisUnreachable

    clock = [1000.0]
    monkeypatch.setattr(linkwatch.time, "monotonic", lambda: clock[0])
    watch = linkwatch.LinkWatch("t", lambda: "n0", give_up_s=30.0, give_up_timed=False)
    backoff = watch.new_backoff()
    down = redis.ConnectionError("down")

    def retry_for(seconds, deadline=None):
        """A retry loop's failures, one every 2 s (the longest backoff)."""
        end = clock[0] + seconds
        while clock[0] < end:
            watch.pause(down, deadline, backoff)
            clock[0] += 2.0

    retry_for(20)
    watch.pause(down, clock[0] + 3600, backoff)  # a timed wait: within its timeout, no give-up
    retry_for(20, deadline=clock[0] + 3600)
    with pytest.raises(RedisUnreachable):
        watch.pause(down, None, backoff)  # a wait with no timeout: 40 s down, past 30
    clock[0] += 3600  # idle, the links working unseen; then a blip
    assert watch.pause(down, None, backoff) <= linkwatch.LinkWatch.CAP_S  # retried, not given up
    retry_for(20)  # the blip's own 20 s: within the give-up


def test_a_link_failing_past_the_deadline_is_redis_unreachable_not_a_timeout(redis_url, ghost, monkeypatch):
    """A read that fails on a lost link after the caller's deadline (a hung server answers nothing
    until the socket times out): JobTimeout said the job was slow, and no link loss was logged."""
    import time

    from mlxq.producer.client import Job
    from mlxq.shared.connection import RedisUnreachable

    client = Client(redis_url, model="ghost")
    try:
        job = client.submit(prompt="a", max_tokens=4)

        def hung(self, op):
            time.sleep(0.3)
            raise redis.TimeoutError("Timeout reading from socket (forced)")

        for name in ("_io_read_record", "_io_wait_done", "_io_read_events", "_io_receive"):
            monkeypatch.setattr(Job, name, hung)
        for wait in (lambda: job.result(timeout=0.1), lambda: list(job.stream(timeout=0.1))):
            with pytest.raises(RedisUnreachable):
                wait()
    finally:
        client.close()


def test_a_handle_sharing_a_subscription_its_first_handle_never_sent_retries_at_once(redis_url, ghost,
                                                                                     monkeypatch):
    """Two async handles on one job: the second shares the first's pending subscription. The first is
    cancelled (a gateway client hung up) before its SUBSCRIBE went out: the second waited out the whole
    confirmation time, then failed, and a reader task with no connection logged an error every 0.1 s.
    Now it hears at once that nothing was sent, and its stream goes on."""
    from redis.asyncio.client import PubSub

    real = PubSub.subscribe
    gate = asyncio.Event()

    async def slow_subscribe(self, *args, **kwargs):  # (connecting to a far Redis)
        await gate.wait()
        return await real(self, *args, **kwargs)

    async def run():
        client = AsyncClient(redis_url, model="ghost")
        client.subscriber.confirm_timeout = 600.0
        try:
            job = await client.submit(prompt="a", max_tokens=4, subscribe=False)
            first, second = await client.job(job.id), await client.job(job.id)
            monkeypatch.setattr(PubSub, "subscribe", slow_subscribe)
            a = asyncio.ensure_future(first._ensure_pubsub())
            await asyncio.sleep(0)  # (a is in its SUBSCRIBE)
            b = asyncio.ensure_future(second._ensure_pubsub())
            for _ in range(100):
                await asyncio.sleep(0)
            a.cancel()
            with pytest.raises(redis.ConnectionError, match="not sent"):
                await asyncio.wait_for(b, 60)
            monkeypatch.setattr(PubSub, "subscribe", real)
            gate.set()
            await asyncio.wait_for(second._ensure_pubsub(), 60)  # subscribes afresh
        finally:
            await client.aclose()

    asyncio.run(run())


def test_a_file_closed_under_the_sync_reader_is_one_warning_and_the_stream_goes_on(redis_url, tiny_model, caplog):
    """The pub/sub socket closed under the sync reader's read (as a thread reconnecting on it does when a
    Cluster master dies: "I/O operation on closed file"): one warning line, no traceback, the channels
    move to a new link and the stream is exact."""
    import logging

    caplog.set_level(logging.WARNING)
    with running_worker(tiny_model, redis_url, max_batch=1), \
            Client(redis_url, model="tiny", settings=fast_settings(redis_url)) as client:
        job = client.submit(prompt="once upon a time", max_tokens=64, ignore_eos=True)
        deltas = job.stream(timeout=120)
        got = [next(deltas)]
        [reader] = client.subscriber._readers.values()
        reader.pubsub.connection._parser._buffer.close()  # as disconnect() from another thread does: the
        # reader's next read raises ValueError("I/O operation on closed file")
        got += list(deltas)
        res = job.result(timeout=120)
        assert wait_for(lambda: reader.failed.is_set(), timeout=30)
    assert [t for d in got for t in d.token_ids] == res.token_ids and len(res.token_ids) == 64
    assert "".join(d.text for d in got) == res.text
    assert not [r for r in caplog.records if r.exc_info] and "pub/sub reader error" not in caplog.text
