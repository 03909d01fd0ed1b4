"""Errors that say what to do, at once, and the small things a new user trips over:
an unknown model is a NoModelError naming the served ones; a model with no live worker is accepted and
said so ("queued, no live worker for MODEL"), left out of /v1/models and answered 503 + Retry-After by
the gateway with nothing queued; a missing model is one line and a non-zero exit; `mlxq redis`;
--metrics-host; every option's help shows its default; `mlxq stats`' average after one job."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import pytest
import redis

from mlxq import AsyncClient, Client
from mlxq.cli import build_parser, main
from mlxq.cli.options import DefaultsFormatter
from mlxq.producer.errors import NoModelError
from mlxq.producer.registry import decode_registry
from mlxq.shared import apikeys, codec
from mlxq.shared.acl import producer_rules
from mlxq.shared.keys import GlobalKeys
from mlxq.shared.protocol import load_functions
from workerkit import fast_settings, neutral_cwd, running_worker, wait_for

GK = GlobalKeys()
from repokit import ROOT
FOREVER = time.time() + 10 * 365 * 86400  # a heartbeat that stays fresh for the whole test


def register(r, name: str, seen_at=None) -> None:
    """A model as a worker registers it; ``seen_at`` None: registered once, no worker alive now."""
    info = {"name": name, "context_length": 4096, "max_token_bytes": 8}
    if seen_at is not None:
        info["seen_at"] = seen_at
    r.hset(GK.models, name, codec.pack(info))


def model_keys_exist(r, model: str) -> list:
    return [k for k in r.keys("*") if f"{{mlxq:{model}}}".encode() in k and not k.endswith((b":apikeys", b":policy"))]


@pytest.fixture
def rr(redis_url):
    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()


# -- unknown model ---------------------------------------------------------------------------------------
def test_unknown_model_is_a_no_model_error_naming_the_served_ones(redis_url, rr):
    register(rr, "tiny", FOREVER)
    register(rr, "other")
    with pytest.raises(NoModelError) as err:
        Client(redis_url, model="nope").submit("hi", max_tokens=2)
    assert "'nope'" in str(err.value) and "other, tiny" in str(err.value)

    async def async_submit():
        async with AsyncClient(redis_url, model="nope") as c:
            await c.submit("hi", max_tokens=2)

    with pytest.raises(NoModelError) as err:
        asyncio.run(async_submit())
    assert "other, tiny" in str(err.value)
    assert model_keys_exist(rr, "nope") == []  # nothing was queued


def test_with_nothing_registered_yet_a_job_waits_and_says_so(redis_url):
    """A fresh deployment: producers may start before any worker has registered its model."""
    job = Client(redis_url).submit("hi", model="first", max_tokens=2)
    assert job.status() == "queued, no live worker for first"


def test_cli_submit_unknown_model_fails_at_once(redis_url, rr, capsys):
    register(rr, "tiny", FOREVER)
    assert main(["submit", "hello", "--model", "nope", "--redis-url", redis_url]) == 2
    err = capsys.readouterr().err
    assert "NoModelError" in err and "'nope'" in err and "tiny" in err


def test_a_registry_entry_that_cannot_be_decoded_still_names_a_model():
    assert decode_registry({b"m": b"", b"n": codec.pack({"name": "n"})}) == {"m": {}, "n": {"name": "n"}}


def test_model_info_is_one_registry_entry_from_the_sync_and_the_async_client(redis_url, rr):
    register(rr, "tiny", FOREVER)

    async def infos():
        async with AsyncClient(redis_url) as c:
            return await c.model_info("tiny"), await c.model_info("nope")

    c = Client(redis_url)
    try:
        sync, models = (c.model_info("tiny"), c.model_info("nope")), c.models()
    finally:
        c.close()
    assert sync == asyncio.run(infos()) == (models["tiny"], {})
    assert sync[0]["context_length"] == 4096


def test_a_producer_that_may_not_read_the_registry_submits_unchecked(redis_url, rr, caplog):
    """Fail open: a Redis user without read access to the model registry still submits (no check)."""
    register(rr, "tiny")
    load_functions(rr)
    apikeys.sync_model(rr, rr, GK, "tiny")
    rules = [r for r in producer_rules("pw-no-registry") if r != f"%R~{GK.models}"]
    rr.execute_command("ACL", "SETUSER", "blind", *rules)
    try:
        url = redis_url.replace("redis://", "redis://blind:pw-no-registry@", 1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(url).hgetall(GK.models)
        with caplog.at_level(logging.INFO, logger="mlxq.producer"):
            job = Client(url, model="tiny").submit("hi", max_tokens=2)
        assert job.status() == "queued"  # no registry: the bare status
        assert Client(url).model_info("tiny") is None  # unreadable, not "no such model"
    finally:
        rr.execute_command("ACL", "DELUSER", "blind")


# -- no live worker ------------------------------------------------------------------------------------
def test_a_model_with_no_live_worker_is_accepted_and_said_so(redis_url, rr):
    register(rr, "ghost")  # registered once, its worker gone
    job = Client(redis_url, model="ghost").submit("hi", max_tokens=2)
    assert job.status() == "queued, no live worker for ghost"
    assert rr.hget(GK.model_keys("ghost").job(job.id), "status") == b"queued"  # the job itself is queued

    async def async_status():
        async with AsyncClient(redis_url, model="ghost") as c:
            return await (await c.submit("hi", max_tokens=2)).status()

    assert asyncio.run(async_status()) == "queued, no live worker for ghost"
    register(rr, "ghost", FOREVER)  # a worker heartbeats again
    assert job.status() == "queued"


def test_cli_submit_says_no_live_worker_and_waits(redis_url, rr):
    register(rr, "ghost")
    env = {**os.environ, "MLXQ_REDIS_URL": redis_url}
    proc = subprocess.Popen([sys.executable, "-m", "mlxq", "submit", "hi", "--queue", "ghost", "--max-tokens", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=neutral_cwd(), text=True)
    guard = threading.Timer(120, proc.kill)  # a hang guard, not a timing assertion
    guard.start()
    try:
        line = proc.stderr.readline()
        assert "queued, no live worker for ghost" in line, line
        assert proc.poll() is None  # still waiting for a worker: the job stays queued
    finally:
        guard.cancel()
        proc.kill()
        proc.communicate()
    assert rr.zcard(GK.model_keys("ghost").queue) == 1


@pytest.fixture
def gateway(redis_url):
    from mlxq.producer.gateway import ServerThread, create_app

    with ServerThread(create_app(redis_url, fast_settings(redis_url, no_worker_wait_s=0.0))) as url:
        yield url


def _post(url: str, path: str, body: dict):
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, dict(resp.getheaders()), json.loads(resp.read() or b"null")


def test_gateway_lists_only_models_with_a_live_worker(gateway, rr):
    import openai

    register(rr, "ghost")
    register(rr, "alive", FOREVER)
    ids = [m.id for m in openai.OpenAI(base_url=gateway + "/v1", api_key="EMPTY").models.list().data]
    assert ids == ["alive"]


@pytest.mark.parametrize("stream", [False, True])
def test_gateway_answers_503_with_retry_after_and_queues_nothing(gateway, rr, stream):
    register(rr, "ghost")
    status, headers, body = _post(gateway, "/v1/completions",
                                  {"model": "ghost", "prompt": "hi", "max_tokens": 2, "stream": stream})
    assert status == 503 and body["error"]["code"] == "no_live_worker", body
    assert int(headers["retry-after"]) >= 1
    assert model_keys_exist(rr, "ghost") == []  # nothing half-queued
    status, _, body = _post(gateway, "/v1/completions", {"model": "nope", "prompt": "hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_gateway_503_through_the_openai_client(gateway, rr):
    import openai

    register(rr, "ghost")
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="EMPTY", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="ghost", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert err.value.status_code == 503 and err.value.response.headers.get("retry-after")


# -- model loading errors ----------------------------------------------------------------------------------
def _worker_stderr(model: str, tmp_path) -> tuple[int, str]:
    env = {**os.environ, "MLXQ_REDIS_URL": "redis://127.0.0.1:1/0", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "mlxq", "worker", "--model", model, "--log-level", "WARNING"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    return proc.returncode, proc.stderr


def test_a_missing_model_directory_is_one_clear_line(tmp_path):
    rc, err = _worker_stderr(str(tmp_path / "no-such-dir"), tmp_path)
    assert rc != 0
    assert err.strip().count("\n") == 0, err  # one line, no traceback
    assert str(tmp_path / "no-such-dir") in err and "does not exist" in err and "make-model" in err


def test_a_hub_id_not_in_the_cache_is_one_clear_line(tmp_path):
    rc, err = _worker_stderr("someone/not-cached-model", tmp_path)
    assert rc != 0
    assert err.strip().count("\n") == 0, err
    assert "'someone/not-cached-model'" in err and "not in the local Hugging Face cache" in err
    assert str(tmp_path / "hf") in err and "hf download someone/not-cached-model" in err


def test_a_directory_that_is_not_a_model_is_one_clear_line(tmp_path):
    (tmp_path / "empty").mkdir()
    rc, err = _worker_stderr(str(tmp_path / "empty"), tmp_path)
    assert rc != 0 and err.strip().count("\n") == 0, err
    assert "is not an mlx-lm model directory" in err and "config.json" in err


# -- the command line --------------------------------------------------------------------------------------
def _all_parsers(parser: argparse.ArgumentParser, name: str = "mlxq"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _all_parsers(sub, f"{name} {sub_name}")


def test_every_option_has_help_that_shows_its_default():
    missing = []
    for name, parser in _all_parsers(build_parser()):
        fmt = DefaultsFormatter(name)
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)) \
                    or action.help == argparse.SUPPRESS:  # --help, --version; an old spelling kept hidden
                continue
            text = fmt._get_help_string(action) if action.help else ""
            if not text:
                missing.append(f"{name} {action.dest}: no help")
            elif action.option_strings and not action.required and "default" not in text.lower() \
                    and "(required)" not in text:
                missing.append(f"{name} {'/'.join(action.option_strings)}: no default in {text!r}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("argv,expected", [
    (["submit", "--help"], ("most tokens to generate (default: 256, as Client's", "(default: 0.0)", "(default: off)")),
    (["gateway", "--help"], ("(default: 127.0.0.1)", "(default: 8000)", "--no-worker-wait")),
    (["worker", "--help"], ("--metrics-host", "(default: 127.0.0.1)")),
])
def test_help_shows_defaults(argv, expected, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for text in expected:
        assert text in out, (text, out)


def _worker_settings(argv):
    """The settings ``mlxq worker`` would run with (flags over $MLXQ_*, over the defaults)."""
    from mlxq.cli.worker import settings_from_args

    return settings_from_args(build_parser().parse_args(argv))


def test_metrics_bind_loopback_unless_told(fake_redis):
    from mlxq.shared.keys import ModelKeys
    from mlxq.worker.metrics import WorkerMetrics

    assert _worker_settings(["worker", "--model", "m"]).metrics_host == "127.0.0.1"
    assert _worker_settings(["worker", "--model", "m", "--metrics-host", "0.0.0.0"]).metrics_host == "0.0.0.0"
    m = WorkerMetrics(fake_redis, ModelKeys("m"), "m")
    try:
        m.serve(0)
        assert m._server.server_address[0] == "127.0.0.1"
    finally:
        m.shutdown()


def test_compose_exposes_the_metrics_port_to_prometheus():
    from composekit import compose, mlxq_invocations

    (worker,) = mlxq_invocations(compose()["services"]["worker"]["command"])
    assert _worker_settings(worker[1:]).metrics_host == "0.0.0.0"  # Prometheus is another container


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlxq_redis_runs_valkey_in_the_foreground_with_a_data_dir(tmp_path):
    port, data = _free_port(), tmp_path / "data"
    proc = subprocess.Popen([sys.executable, "-m", "mlxq", "redis", "--port", str(port), "--data-dir", str(data)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=neutral_cwd())
    try:
        r = redis.Redis(port=port, socket_timeout=5)

        def up():
            try:
                return r.ping()
            except redis.ConnectionError:
                return False

        assert wait_for(up, timeout=60)
        r.set("k", "v")
        assert r.config_get("dir")["dir"] == str(data.resolve())
        assert r.config_get("appendonly")["appendonly"] == "yes"
        r.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert (data / "appendonlydir").is_dir()


def test_progress_off_a_terminal_is_two_log_lines_and_no_bar(caplog, capsys):
    from mlxq.worker import progress

    log = logging.getLogger("mlxq.test.progress")
    with caplog.at_level(logging.INFO, logger="mlxq.test.progress"):
        with progress.step(log, "doing a thing", total=3, unit="part", expect="~1 s") as bar:
            for _ in range(3):
                bar.update()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "doing a thing (~1 s) ..." and lines[1].startswith("doing a thing: done after ")
    assert capsys.readouterr().err == ""  # no bar off a terminal


# -- stats ---------------------------------------------------------------------------------------------
def test_stats_average_counts_a_finished_job(redis_url, tiny_model):
    from mlxq.producer import stats

    with running_worker(tiny_model, redis_url):
        client = Client(redis_url, model="tiny", settings=fast_settings(redis_url))
        assert wait_for(lambda: "tiny" in client.models(), timeout=60)
        res = client.submit("Once upon a time", max_tokens=8, ignore_eos=True).result(timeout=120)
        assert res.stats.generated_tokens == 8

        def counted():
            return stats.collect(client.redis)["tiny"]["tokens_generated"] >= 8

        assert wait_for(counted, timeout=30)  # the worker publishes its stats when a job finishes
        agg = stats.collect(client.redis)["tiny"]
        assert agg["tok_s_avg"] > 0
        assert "average=0.0" not in stats.render({"tiny": agg})


# -- the Client examples of README and the docs' bulk page ----------------------------------------------
def _readme_python_block(needle: str, page: str = "README.md") -> str:
    import re

    text = (ROOT / page).read_text()
    (code,) = [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M) if needle in m.group(1)]
    return code


def _run_snippet(code: str, redis_url: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace("redis://localhost:6379/0", redis_url), "README.md", "exec"),
             {"__name__": "readme_example"})
    return out.getvalue()


def test_readme_client_snippets_print_their_lines_apart(redis_url, tiny_model):
    """The quickstart's Client snippet ends the streamed text before the usage line; the map example
    prints one line per item, saying how many tokens each produced (whatever the weights say)."""
    with running_worker(tiny_model, redis_url):
        r = redis.Redis.from_url(redis_url)
        assert wait_for(lambda: r.hexists(GK.models, "tiny"), timeout=60)
        r.close()
        out = _run_snippet(_readme_python_block('model="tiny")\njob = client.submit('), redis_url)
        assert out.endswith("\n") and out.splitlines()[-1].startswith("tokens: "), out
        lines = _run_snippet(_readme_python_block("client.map(items", "docs/producers/bulk.md"), redis_url).splitlines()
    assert len(lines) == 2 and all(" tokens: " in ln for ln in lines), lines
