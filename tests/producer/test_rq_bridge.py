"""rq interop: jobs enqueued with plain rq run on an mlxq worker (through the bridge) or on a plain
rq worker (which submits through the Client), and rq's own API reads their status and results."""

from __future__ import annotations

import datetime
import pickle
import sys
import zlib

import pytest
import redis
import rq
from click.testing import CliRunner
from rq.cli import main as rq_cli
from rq import Queue, SimpleWorker
from rq.job import Job, JobStatus
from rq.results import Result as RqResult

from mlxq.shared import codec
from mlxq.shared import apikeys
from mlxq.shared.keys import GlobalKeys
from workerkit import fast_settings, job_fields, running_worker, wait_for
from mlxq.producer.rq_bridge import FUNC_PATH, RqBridge, SafePickle, tier_for_queue

GK = GlobalKeys()


def mlxq_job(r, rq_job: Job) -> dict:
    job_id = rq_job.get_meta()["mlxq_job_id"]
    return job_fields(r, GK.model_keys("tiny").job(job_id))



@pytest.fixture(scope="module", autouse=True)
def _sys_path_kept():
    """rq's worker puts its --path ('.', the checkout's root here) on sys.path: take it off after this
    module, or the later tests would see the checkout's producer/, worker/ and shared/ (test_packaging)."""
    saved = list(sys.path)
    yield
    sys.path[:] = saved

@pytest.fixture
def bridged(tiny_model, redis_url):
    r = redis.Redis.from_url(redis_url)
    settings = fast_settings(redis_url)
    # the rq queue name is a floor on the bridge's own key: a high key lets mlxq-high stay high
    apikeys.add_key(r, GK, "rq-bridge-key-0001", "high")
    bridge = RqBridge(r, "tiny", settings, poll_s=0.05, api_key="rq-bridge-key-0001")
    with running_worker(tiny_model, redis_url, settings, observers=[bridge]):
        bridge.start()
        try:
            yield r, bridge
        finally:
            bridge.stop()
    r.close()


def finished(job: Job) -> bool:
    return job.get_status() in (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED)


def test_plain_rq_enqueue_runs_on_mlxq_and_reads_back_with_rq(bridged, redis_url):
    r, bridge = bridged
    low = Queue("mlxq-low", connection=r).enqueue(FUNC_PATH, prompt="retrieved context: ...", max_tokens=6,
                                                  ignore_eos=True)
    high = Queue("mlxq-high", connection=r).enqueue(FUNC_PATH, "a positional prompt", max_tokens=3)
    for job in (low, high):
        assert wait_for(lambda: finished(job), timeout=20), job.get_status()
    fetched = Job.fetch(low.id, connection=r)  # a fresh handle, rq's default serializer
    assert fetched.get_status() == JobStatus.FINISHED
    value = fetched.return_value()
    assert value["finish_reason"] == "length" and value["usage"]["completion_tokens"] == 6
    assert isinstance(value["text"], str) and len(value["token_ids"]) == 6
    latest = fetched.latest_result()
    assert latest.type == RqResult.Type.SUCCESSFUL and latest.return_value == value
    assert fetched.ended_at is not None and fetched.worker_name == bridge.worker_name
    assert low.id in Queue("mlxq-low", connection=r).finished_job_registry.get_job_ids()
    assert mlxq_job(r, low)["tier"] == b"low" and mlxq_job(r, high)["tier"] == b"high"
    assert Job.fetch(high.id, connection=r).return_value()["finish_reason"] in ("stop", "length")
    assert r.hlen(GK.rq_pending) == 0 and r.llen(GK.rq_intake) == 0
    assert Queue("mlxq-low", connection=r).started_job_registry.count == 0

    out = CliRunner().invoke(rq_cli, ["info", "--url", redis_url, "--only-queues", "mlxq-low", "mlxq-high"])
    assert out.exit_code == 0, out.output
    assert "mlxq-low" in out.output and "mlxq-high" in out.output


def test_invalid_and_unsafe_jobs_fail_in_rq(bridged):
    r, _ = bridged
    q = Queue("mlxq-normal", connection=r)
    bad = q.enqueue(FUNC_PATH, prompt="x", max_tokens=0)
    unsafe = q.enqueue(FUNC_PATH, prompt="x", max_tokens=2, when=datetime.datetime(2024, 1, 1))  # a class in the pickle
    for job in (bad, unsafe):
        assert wait_for(lambda: finished(job), timeout=20)
        assert job.get_status() == JobStatus.FAILED
        assert "mlxq refused the job" in job.latest_result().exc_string
        assert job.id in q.failed_job_registry.get_job_ids()


def test_cancel_in_rq_cancels_the_mlxq_job(bridged):
    r, _ = bridged
    q = Queue("mlxq-low", connection=r)
    job = q.enqueue(FUNC_PATH, prompt="long", max_tokens=3000, ignore_eos=True)
    assert wait_for(lambda: job.get_status() == JobStatus.STARTED and "mlxq_job_id" in job.get_meta(), timeout=60)
    assert q.started_job_registry.get_job_ids() == [job.id]  # "executing" in rq info
    job.cancel()
    assert wait_for(lambda: mlxq_job(r, job).get("status") == b"cancelled", timeout=60)


def test_plain_rq_worker_runs_generate_through_the_client(tiny_model, redis_url, monkeypatch):
    """No bridge: an ordinary rq worker performs generate(), which submits to mlxq and waits, with
    the bridge's own key (MLXQ_RQ_API_KEY) as a worker's --rq-queues does."""
    r = redis.Redis.from_url(redis_url)
    apikeys.add_key(r, GK, "rq-plain-key-0001", "high")
    monkeypatch.setenv("MLXQ_RQ_API_KEY", "rq-plain-key-0001")
    with running_worker(tiny_model, redis_url, fast_settings(redis_url)):
        assert wait_for(lambda: r.hexists(GK.models, "tiny"), timeout=60)
        q = Queue("mlxq-high", connection=r)
        job = q.enqueue(FUNC_PATH, prompt="hello", max_tokens=4, ignore_eos=True)
        SimpleWorker([q], connection=r).work(burst=True, with_scheduler=False)
    job = Job.fetch(job.id, connection=r)
    assert job.get_status() == JobStatus.FINISHED
    assert job.return_value()["usage"]["completion_tokens"] == 4
    assert r.hgetall(GK.model_keys("tiny").counts)[b"done"] == b"1"
    [key] = r.keys(GK.model_keys("tiny").job("*"))
    assert job_fields(r, key)["tier"] == b"high"  # the key's tier: key-less, mlxq-high would run at normal
    r.close()


def test_tier_for_queue():
    assert [tier_for_queue(q) for q in ("mlxq-high", "mlxq-normal", "mlxq-low", "rag", None)] == \
        ["high", "normal", "low", "low", "low"]


def test_safe_pickle_refuses_globals():
    assert SafePickle.loads(pickle.dumps(("f", None, ("a",), {"k": [1, 2.5, None, b"x"]}))) == \
        ("f", None, ("a",), {"k": [1, 2.5, None, b"x"]})
    with pytest.raises(pickle.UnpicklingError):
        SafePickle.loads(pickle.dumps(datetime.date(2024, 1, 1)))


# -- the contract with rq's record format (pyproject: rq>=2.11,<4, the releases whose records match this
# and whose Execution takes a worker_name; this fails if the format moves) --------------------------------

def test_rq_record_contract(redis_url):
    assert (2, 11) <= tuple(int(part) for part in rq.__version__.split(".")[:2]) < (4, 0), rq.__version__
    r = redis.Redis.from_url(redis_url)
    q = Queue("mlxq-low", connection=r)
    job = q.enqueue(FUNC_PATH, prompt="p", max_tokens=2)
    # the queue is a list of job ids under rq:queue:<name> (the bridge LMOVEs from it)
    assert q.key == "rq:queue:mlxq-low" and r.type(q.key) == b"list" and r.lrange(q.key, 0, -1) == [job.id.encode()]
    # the job hash: exactly these fields at enqueue
    h = r.hgetall(f"rq:job:{job.id}")
    assert set(h) == {b"created_at", b"data", b"success_callback_name", b"failure_callback_name",
                      b"stopped_callback_name", b"started_at", b"ended_at", b"last_heartbeat", b"worker_name",
                      b"group_id", b"origin", b"description", b"enqueued_at", b"timeout", b"status"}
    assert h[b"origin"] == b"mlxq-low" and h[b"status"] == b"queued"
    # data: zlib(pickle((func_name, instance, args, kwargs))) of plain values
    assert SafePickle.loads(zlib.decompress(h[b"data"])) == (FUNC_PATH, None, (), {"prompt": "p", "max_tokens": 2})
    # results: a stream rq:results:<id> whose entries carry these fields, return_value = b64(pickle(value))
    fetched = Job.fetch(job.id, connection=r, serializer=SafePickle)
    RqResult.create(fetched, RqResult.Type.SUCCESSFUL, ttl=60, return_value={"text": "t"}, worker_name="w")
    entries = r.xrange(f"rq:results:{job.id}")
    assert len(entries) == 1 and set(entries[0][1]) == {b"type", b"worker_name", b"return_value"}
    assert entries[0][1][b"type"] == b"1"
    assert Job.fetch(job.id, connection=r).latest_result().return_value == {"text": "t"}
    # registries are sorted sets named rq:<kind>:<queue>
    assert q.finished_job_registry.key == "rq:finished:mlxq-low"
    assert q.failed_job_registry.key == "rq:failed:mlxq-low"
    assert q.canceled_job_registry.key == "rq:canceled:mlxq-low"
    assert codec.unpack(codec.pack({"ok": 1})) == {"ok": 1}
    r.close()


def _report(rq_job):
    return f"mlxq job j1 ended: {rq_job}"


def test_rq_dependents_run_after_a_bridged_job_and_callbacks_are_refused(bridged):
    """A job that depends_on a bridged one is enqueued once it ends, as rq's own worker does (it stayed
    deferred forever); a job with an rq callback is refused with a clear error (the bridge runs no code
    the queue names)."""
    r, _ = bridged
    first = Queue("mlxq-low", connection=r).enqueue(FUNC_PATH, prompt="hi", max_tokens=3)
    then = Queue("post", connection=r).enqueue("os.getcwd", depends_on=first)
    assert then.get_status() == JobStatus.DEFERRED
    assert wait_for(lambda: then.get_status() == JobStatus.QUEUED, timeout=30), then.get_status()
    assert first.get_status() == JobStatus.FINISHED and then.id in Queue("post", connection=r).get_job_ids()
    with_callback = Queue("mlxq-low", connection=r).enqueue(FUNC_PATH, prompt="hi", max_tokens=3,
                                                            on_success=rq.Callback(_report))
    assert wait_for(lambda: finished(with_callback), timeout=30)
    assert with_callback.get_status() == JobStatus.FAILED
    assert "does not run rq callbacks (on_success)" in with_callback.latest_result().exc_string


def test_a_tool_call_answer_is_a_success_and_a_refused_key_fails_the_job_not_the_intake(redis_url):
    """finish_reason tool_calls is an answer (it was mirrored as a failure); a job the tier policy
    refuses (anonymous producers refused, no key) fails in rq, and the jobs behind it still move
    (the AuthError stayed in the intake and jammed it)."""
    from mlxq.producer.rq_bridge import Pending
    from mlxq.shared.schemas import JobStats, Result

    r = redis.Redis.from_url(redis_url)
    settings = fast_settings(redis_url)
    bridge = RqBridge(r, "tiny", settings, poll_s=0.05)
    q = Queue("mlxq-low", connection=r)
    job = Queue("elsewhere", connection=r).enqueue(FUNC_PATH, prompt="x", max_tokens=2)  # not for the bridge
    res = Result(id="j1", finish_reason="tool_calls", stats=JobStats(queued_at=0, started_at=0, finished_at=0))
    bridge._mirror_result(Pending(job.id, "tiny", "j1"), res)
    assert job.get_status() == JobStatus.FINISHED
    apikeys.set_policy(r, GK, {}, None, "refuse")
    try:
        a, b = q.enqueue(FUNC_PATH, prompt="a", max_tokens=2), q.enqueue(FUNC_PATH, prompt="b", max_tokens=2)
        assert bridge.move_once() and bridge.move_once()
        for j in (a, b):
            assert j.get_status() == JobStatus.FAILED and "mlxq refused the job" in j.latest_result().exc_string
        assert r.llen(GK.rq_intake) == 0
    finally:
        apikeys.set_policy(r, GK, {}, None, "normal")
        r.close()


def test_a_job_whose_mlxq_record_is_gone_fails_in_rq(redis_url):
    """A bridged job whose mlxq record expired before the bridge read its result (the bridge down
    longer than the result TTL) fails in rq with a message saying so; it stayed "started" forever,
    with its rq callers waiting."""
    import time

    r = redis.Redis.from_url(redis_url)
    r.hset(GK.models, "ghostrq", codec.pack({"vocab_size": 64, "context_length": 64,
                                             "seen_at": time.time() + 10 * 365 * 86400}))
    bridge = RqBridge(r, "ghostrq", fast_settings(redis_url), poll_s=0.05)
    try:
        job = Queue("mlxq-low", connection=r).enqueue(FUNC_PATH, prompt="x", max_tokens=2)
        assert bridge.move_once()
        record = GK.model_keys("ghostrq").job(job.get_meta()["mlxq_job_id"])
        assert bridge.mirror_once() == 0 and job.get_status() == JobStatus.STARTED  # queued, no worker
        r.delete(record)  # as its TTL would
        assert bridge.mirror_once() == 1
        assert job.get_status() == JobStatus.FAILED and "record in Redis is gone" in job.latest_result().exc_string
        assert not r.hexists(GK.rq_pending, job.id) and bridge.mirror_once() == 0
    finally:
        r.hdel(GK.models, "ghostrq")
        r.close()
