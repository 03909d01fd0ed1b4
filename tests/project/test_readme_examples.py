"""The examples of README's gateway section and of the docs pages it moved to, run: README's fenced python
and bash blocks between the ``<!-- ecosystem:start -->`` markers, then every one of the pages in ``PAGES``,
in that order, run against a live gateway + worker (+ rq bridge) on a real Valkey, with ``localhost``
addresses pointed at them.  Only ``docker compose`` lines are skipped (Docker cannot run here; see
tests/project/test_compose.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from mlxq.producer.gateway import ServerThread, create_app
from mlxq.shared.keys import GlobalKeys
from workerkit import fast_settings, running_worker, wait_for
from mlxq.producer.rq_bridge import RqBridge

from repokit import ROOT
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


# the pages of the docs site whose examples run here, in the order they build on each other (a key the
# gateway's page adds is used by the later pages' examples)
PAGES = ("docs/gateway.md", "docs/producers/rq.md", "docs/producers/bulk.md", "docs/producers/structured.md",
         "docs/producers/samples.md", "docs/gateway-responses.md", "docs/gateway-messages.md")


def sections() -> list[tuple[str, str]]:
    """(file, text) of README's marked section, then of each page."""
    text = (ROOT / "README.md").read_text()
    readme = text.split("<!-- ecosystem:start -->", 1)[1].split("<!-- ecosystem:end -->", 1)[0]
    return [("README.md", readme)] + [(page, (ROOT / page).read_text()) for page in PAGES]


def section() -> str:
    return "\n".join(text for _, text in sections())


RUNNABLE = ("bash", "python")  # ```text blocks show what a model writes; they are not run


def blocks() -> list[tuple[str, str, str]]:
    """(file, kind, code) of every runnable block, in order."""
    return [(name, m.group(1), m.group(2)) for name, text in sections() for m in FENCE.finditer(text)
            if m.group(1) in RUNNABLE]


def test_section_has_the_promised_examples():
    kinds = [k for _, k, _ in blocks()]
    assert set(kinds) == set(RUNNABLE)
    assert {m.group(1) for m in FENCE.finditer(section())} <= {*RUNNABLE, "text"}
    text = section()
    for needle in ("docker compose up", "curl ", "from openai import OpenAI", "from rq import Queue",
                   "mlxq batch", "client.map(", "stream=True"):
        assert needle in text, needle


@pytest.fixture
def live(tiny_model, redis_url):
    r = redis.Redis.from_url(redis_url)
    settings = fast_settings(redis_url)
    bridge = RqBridge(r, "tiny", settings, poll_s=0.05)
    with running_worker(tiny_model, redis_url, settings, observers=[bridge]):
        assert wait_for(lambda: r.hexists(GlobalKeys().models, "tiny"), timeout=60)
        bridge.start()
        try:
            with ServerThread(create_app(redis_url, settings)) as url:
                yield url, redis_url
        finally:
            bridge.stop()
    r.close()


def localize(code: str, url: str, redis_url: str) -> str:
    return code.replace("http://localhost:8000", url).replace("redis://localhost:6379/0", redis_url)


def run_bash(code: str, cwd: Path, redis_url: str) -> str:
    preamble = f'mlxq() {{ "{sys.executable}" -m mlxq "$@"; }}\n'
    env = {**os.environ, "MLXQ_REDIS_URL": redis_url}
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", preamble + code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, f"{code}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


def run_python(code: str, cwd: Path, name: str) -> str:
    out = io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, name, "exec", dont_inherit=True), {"__name__": "readme_example"})  # no inherited __future__
    finally:
        os.chdir(old)
    return out.getvalue()


def test_readme_examples_run(live, tmp_path):
    url, redis_url = live
    outputs = []
    opened, page = False, None
    for name, kind, code in blocks():
        if kind == "bash" and all(ln.startswith("docker compose") for ln in code.strip().splitlines()):
            continue  # Docker is not available here
        after_gateway, page = page == "docs/gateway.md" and name != page, name
        if after_gateway and not opened:
            # the gateway page registers a key, and keys mean keys; the other pages are each a reader's
            # own setup, with no key: their callers are let in as the operator can choose to
            run_bash("mlxq tiers --anonymous normal", tmp_path, redis_url)
            opened = True
        code = localize(code, url, redis_url)
        outputs.append(run_bash(code, tmp_path, redis_url) if kind == "bash" else run_python(code, tmp_path, name))
    text = "\n".join(outputs)
    assert '"object":"chat.completion"' in text and '"total_tokens"' in text  # curl, non-streaming
    assert "data: [DONE]" in text  # curl, streaming
    assert "['tiny']" in text and "usage:" in text  # openai client
    assert "finished" in text  # rq: job.get_status()
    assert "mlxq_gateway_requests_total" in text  # the gateway's /metrics
    assert "resumed: response." in text and "follow-up: True" in text  # the Responses API
    results = [ln for ln in (tmp_path / "results.jsonl").read_text().splitlines() if ln]
    assert len(results) == 2  # mlxq batch, run twice: each line once
    # structured output and tool calls (whether the tiny model's answers complete within max_tokens is up
    # to its weights: tests/cli/test_cli_structured.py, test_bulk.py and the grammar's tests check validity)
    assert text.count("ticket: ") == 1 and text.count("bulk: ") == 2 and "json: " in text and "finish: " in text
    triaged = [json.loads(ln) for ln in (tmp_path / "triaged.jsonl").read_text().splitlines() if ln]
    assert [t["response"]["status_code"] for t in triaged] == [200, 200], triaged
