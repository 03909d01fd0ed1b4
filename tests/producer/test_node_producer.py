"""Any service, any language: the Node.js producer of docs/PROTOCOL.md (examples/node/producer.mjs, npm's
``redis`` and ``@msgpack/msgpack``) enqueues a job, streams its deltas from the channel and reads the
result, against a real worker; its text equals the Python client's for the same greedy request."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import redis

from mlxq import Client
from mlxq.shared import codec
from mlxq.shared.keys import GlobalKeys
from workerkit import fast_settings, running_worker, wait_for
from refkit import greedy, pick_prompt

from repokit import ROOT
EXAMPLE = ROOT / "examples" / "node" / "producer.mjs"
NPM_PACKAGES = ["redis@4", "@msgpack/msgpack@3"]
MULTIBYTE_PROMPTS = ("café, naïve: 日本語 and more", "Crème brûlée in Zürich is", "The 日本語 word for tea is",
                     "über the sea, naïve and", "emoji 🚀 and the")


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory):
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node and npm are not installed: the Node.js producer example cannot run here")
    d = tmp_path_factory.mktemp("node-producer")
    # npm's own cache (~/.npm) makes a repeat install take a couple of seconds
    proc = subprocess.run([npm, "install", "--prefix", str(d), "--no-audit", "--no-fund", *NPM_PACKAGES],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"npm install failed:\n{proc.stderr[-2000:]}")
    shutil.copy(EXAMPLE, d / "producer.mjs")  # next to its node_modules (ES modules ignore NODE_PATH)
    return d


def test_the_example_in_the_protocol_doc_is_the_tested_file():
    assert EXAMPLE.read_text() in (ROOT / "docs" / "PROTOCOL.md").read_text()


def run_node(node_dir: Path, url: str, prompt: str, max_tokens: int, api_key: str | None = None,
             schema: dict | None = None, **extra_env: str) -> dict:
    env = {**os.environ, "MLXQ_REDIS_URL": url, "MLXQ_MODEL": "tiny", **extra_env}
    env.pop("MLXQ_API_KEY", None)
    if api_key:
        env["MLXQ_API_KEY"] = api_key
    argv = [shutil.which("node"), "producer.mjs", prompt, str(max_tokens)] + ([json.dumps(schema)] if schema else [])
    proc = subprocess.run(argv, cwd=node_dir, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_node_producer_streams_the_same_text_as_the_python_client(node_dir, tiny_model, redis_url):
    settings = fast_settings(redis_url)
    r = redis.Redis.from_url(redis_url)
    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        client = Client(redis_url, model="tiny", settings=settings)
        # a multi-byte prompt whose greedy answer is not empty on this run's weights (the Node example
        # has no ignore_eos): picked from mlx-lm's answers, computed here
        multibyte, _, _ = pick_prompt(tiny_model, MULTIBYTE_PROMPTS, 24, lambda ids, text: bool(text), "text")
        for prompt, n in (("A recipe for bread starts with", 3), (multibyte, 24)):
            py = client.submit(prompt, max_tokens=n, temperature=0.0).result(timeout=60)
            out = run_node(node_dir, redis_url, prompt, n)
            assert out["streamed"] == out["text"] == py.text, prompt  # deltas == result == Python's
            assert (py.token_ids, py.text) == greedy(tiny_model, prompt, n), prompt  # == mlx-lm's
            assert out["token_ids"] == py.token_ids and out["finish_reason"] == py.finish_reason
            assert out["usage"] == {"prompt_tokens": py.stats.prompt_tokens,
                                    "completion_tokens": py.stats.generated_tokens}
            # the tier Redis gave it at enqueue (the finished record keeps it in its result's stats)
            record = codec.unpack(r.hget(GlobalKeys().model_keys("tiny").job(out["id"]), "result"))
            assert out["tier"] == record["stats"]["tier"] == "normal"
        assert out["text"] and py.text
        # the tier comes from the key, as for every producer
        from mlxq.shared import apikeys

        apikeys.add_key(r, GlobalKeys().api_keys, "node-service-key", "high")
        out = run_node(node_dir, redis_url, "hello", 2, api_key="node-service-key")
        assert out["tier"] == "high" and out["finish_reason"] in ("stop", "length")
        assert wait_for(lambda: r.hget(GlobalKeys().model_keys("tiny").job(out["id"]), "status") == b"done")
    r.close()


SEA = {"type": "object", "properties": {"mood": {"enum": ["calm", "stormy"]},
                                        "waves": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["mood", "waves"], "additionalProperties": False}
SEA_PROMPTS = ("The sea today:", "Weather report:", "Sea state, as JSON:", "Sailing log.", "Harbour news:",
               "Today at the coast", "The waves are", "Ship's report:")


def test_node_producer_submits_a_json_schema_job(node_dir, tiny_model, redis_url):
    """The example's third argument, a JSON Schema, goes in the request as ``response_format``: the result
    parses (the example's own JSON.parse), validates, and equals the Python client's for the same request.
    (The constraint lets a model with a reasoning block think first, and a random-ish model may think past
    max_tokens: the prompt is one whose greedy answer, computed here by the Python client, completes.)"""
    import jsonschema

    settings = fast_settings(redis_url)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SEA}}  # as the example sends it
    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        client = Client(redis_url, model="tiny", settings=settings)
        jobs = {p: client.submit(p, max_tokens=64, temperature=0.0, response_format=fmt) for p in SEA_PROMPTS}
        done = {p: job.result(timeout=120) for p, job in jobs.items()}
        prompt, py = next(((p, res) for p, res in done.items() if res.finish_reason == "stop"), (None, None))
        assert prompt is not None, {p: (res.finish_reason, res.text[:60]) for p, res in done.items()}
        out = run_node(node_dir, redis_url, prompt, 64, schema=SEA)
    assert out["finish_reason"] == "stop", out
    jsonschema.validate(out["parsed"], SEA)
    assert out["streamed"] == out["text"] == py.text and out["parsed"] == json.loads(py.text)


def test_node_producer_sends_a_time_limit(node_dir, tiny_model, redis_url):
    """MLXQ_TIMEOUT_S goes in the request as ``timeout_s``; a value the request refuses (0) fails the job
    at the worker with a message that names the field (a producer in another language relies on it)."""
    settings = fast_settings(redis_url)
    r = redis.Redis.from_url(redis_url)
    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        out = run_node(node_dir, redis_url, "hello", 2, MLXQ_TIMEOUT_S="60")
        assert out["finish_reason"] in ("stop", "length")
        req = codec.unpack(r.hget(GlobalKeys().model_keys("tiny").job(out["id"]), "req"))
        assert req["timeout_s"] == 60
        out = run_node(node_dir, redis_url, "hello", 2, MLXQ_TIMEOUT_S="0")
        assert out["finish_reason"] == "error" and "timeout_s" in out["error"], out
    r.close()


def test_node_producer_sends_a_life_of_its_own(node_dir, redis_url):
    """MLXQ_DEFER_S and MLXQ_EXPIRES_IN go in the request and in enqueue's ARGV 7-8 (PROTOCOL.md section 9):
    an expiry already past is refused by the script, with its reason; a deferred job waits in the deferred
    set with the run_at its request carries (no worker needed: the wait is in Redis)."""
    from mlxq.shared import apikeys
    from mlxq.shared.protocol import load_functions

    # what a worker does at start (no worker here): the policy, its slot copy, mlxq's Functions
    r = redis.Redis.from_url(redis_url)
    apikeys.seed_policy(r, GlobalKeys(), {"high": 0, "normal": 30, "low": 300}, 10_000)
    apikeys.sync_model(r, r, GlobalKeys(), "tiny")
    load_functions(r)
    env = {**os.environ, "MLXQ_REDIS_URL": redis_url, "MLXQ_MODEL": "tiny", "MLXQ_EXPIRES_IN": "-5"}
    proc = subprocess.run([shutil.which("node"), "producer.mjs", "hi", "2"], cwd=node_dir, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "invalid_time expires_at is already past" in proc.stderr
    k = GlobalKeys().model_keys("tiny")
    env.update(MLXQ_EXPIRES_IN="600", MLXQ_DEFER_S="300")
    node = subprocess.Popen([shutil.which("node"), "producer.mjs", "hi", "2"], cwd=node_dir, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: r.zcard(k.deferred) == 1, timeout=60)
        (job_id, run_at), = r.zrange(k.deferred, 0, -1, withscores=True)
        req = codec.unpack(r.hget(k.job(job_id.decode()), "req"))
        assert req["run_at"] == pytest.approx(run_at) and req["expires_at"] == pytest.approx(run_at + 300)
        assert r.zcard(k.queue) == 0 and r.zscore(k.expiring, job_id) == pytest.approx(req["expires_at"])
    finally:
        node.kill()
        node.wait(timeout=10)
        r.close()
