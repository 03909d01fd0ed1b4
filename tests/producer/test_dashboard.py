"""The dashboard in a real browser (Debian's chromium through Playwright; tests/kit/browserkit.py) against
a real Valkey, a worker on the tiny model and the dashboard's server, all shared by the module's tests
(in file order: the worker starts in the first, the keys are registered in the last). Every wait is on
the page (Playwright's expect polls the DOM), none on a clock.

Set $MLXQ_DASHBOARD_SHOTS to a folder to have the overview and a job page saved there as PNGs (the
docs' screenshots, docs/operations/img/)."""

from __future__ import annotations

import contextlib
import os
import re

import httpx
import pytest
import redis

from browserkit import FLAGS, chromium
from mlxq import Client
from mlxq.shared import apikeys
from mlxq.shared.keys import GlobalKeys
from workerkit import fast_settings, model_without_worker, running_worker, wait_for

ADMIN_KEY, PRODUCER_KEY = "dash-admin-key-0123456789", "dash-producer-key-0123456789"


class Stack:
    def __init__(self, url, tiny_model, settings, dashboard_url, browser, stack: contextlib.ExitStack):
        self.url, self.tiny, self.settings, self.base = url, tiny_model, settings, dashboard_url
        self.browser, self._stack, self._worker = browser, stack, None
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.expect_timeout_ms = 30_000

    def start_worker(self) -> None:
        if self._worker is None:
            self._worker = self._stack.enter_context(running_worker(self.tiny, self.url, self.settings))

    def page(self, path: str):
        page = self.context.new_page()
        page.set_default_timeout(self.expect_timeout_ms)
        page.goto(self.base + path)
        return page

    def client(self, **kw) -> Client:
        return Client(self.url, model=self.tiny.name, settings=self.settings, **kw)


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model):
    path, why = chromium()
    if path is None:
        pytest.skip(f"browser tests skipped: {why}")
    from playwright.sync_api import sync_playwright

    from mlxq.producer.dashboard import create_dashboard
    from mlxq.producer.gateway import ServerThread

    url = redis_server.url
    redis.Redis.from_url(url).flushall()
    # a point of the plots every second (10 s in a deployment): the first page already has some
    settings = fast_settings(url, series_interval_s=1.0)
    with contextlib.ExitStack() as es:
        es.enter_context(model_without_worker(url, tiny_model.name))  # jobs queue before the worker starts
        base = es.enter_context(ServerThread(create_dashboard(url, settings)))
        pw = es.enter_context(sync_playwright())
        browser = pw.chromium.launch(executable_path=path, args=FLAGS, headless=True)
        es.callback(browser.close)
        yield Stack(url, tiny_model, settings, base, browser, es)


def shot(page, name: str) -> None:
    folder = os.environ.get("MLXQ_DASHBOARD_SHOTS")
    if folder:
        page.screenshot(path=os.path.join(folder, name), full_page=True)


def test_a_running_jobs_output_counts_each_token_once_and_an_ended_ones_comes_from_its_result(fake_redis):
    """The job page's text (views.job_output): a running job's from its stream, where a retried attempt's
    deltas overlap what an earlier one wrote; an ended one's from its result (the stream was folded
    into the record)."""
    from mlxq.producer.dashboard.views import job_output
    from mlxq.shared import codec
    from mlxq.shared.schemas import Delta

    k = GlobalKeys().model_keys("m")
    fake_redis.hset(k.job("j1"), mapping={"status": "running"})
    for a, n, c, text in ((1, 0, 0, "Hel"), (1, 1, 3, "lo"), (2, 1, 3, "lo, w")):  # attempt 2 resumes at token 1
        d = Delta(attempt=a, seq=n, index=n, offset=c, text=text, token_ids=list(range(n, n + len(text))))
        fake_redis.xadd(k.events("j1"), {"d": codec.pack(d.to_wire())})
    assert job_output(fake_redis, "mlxq", "m", "j1") == {"status": "running", "text": "Hello, w", "done": False}
    fake_redis.hset(k.job("j1"), mapping={"status": "done",
                                          "result": codec.pack({"text": "Hello, world", "finish_reason": "stop"})})
    out = job_output(fake_redis, "mlxq", "m", "j1")
    assert (out["text"], out["done"], out["finish_reason"]) == ("Hello, world", True, "stop")


def test_overview_shows_the_queue_draining_and_a_job_page_its_tokens_arriving(stack):
    from playwright.sync_api import expect

    with stack.client() as c:
        jobs = [c.submit(f"count to {i}", max_tokens=24, subscribe=False) for i in range(3)]
    overview = stack.page("/")
    row = overview.locator(f'#models tr[data-model="{stack.tiny.name}"]')
    expect(row.locator('td[data-queued="normal"]')).to_have_text("3")
    watched = stack.page(f"/jobs/{jobs[0].id}")
    expect(watched.locator("#status")).to_have_text("queued")
    expect(watched.locator("#output")).to_have_text("")

    stack.start_worker()
    expect(row.locator('td[data-queued="normal"]')).to_have_text("0")  # the live table, refreshed in place
    expect(overview.locator("#workers tbody tr")).to_have_count(1)
    with stack.client() as c:
        reference = c.job(jobs[0].id).result(timeout=60).text
    expect(watched.locator("#job")).to_have_attribute("data-done", "1")
    assert watched.locator("#status").text_content() == "done"
    assert watched.locator("#output").text_content() == reference  # every token, once, in order
    assert watched.locator("#finish").text_content() in ("stop", "length")
    shot(watched, "dashboard-job.png")

    overview.reload()  # the plots: the worker's points of the last hour, drawn by uPlot
    charts = overview.locator(f'section.charts[data-model="{stack.tiny.name}"]')
    expect(charts).to_have_attribute("data-points", re.compile(r"^[1-9]"))
    expect(charts.locator("canvas")).to_have_count(4)


def test_cancel_from_the_job_page(stack):
    from playwright.sync_api import expect

    with stack.client() as c:
        job = c.submit("wait for me", max_tokens=4, defer_s=3600, subscribe=False)
        page = stack.page(f"/jobs/{job.id}")
        page.click("#cancel")
        expect(page.locator("#question")).to_contain_text(job.id)
        page.click("#confirm")
        expect(page.locator("#note")).to_have_text("cancelled")
        expect(page.locator("#status")).to_have_text("cancelled")
        assert c.job(job.id).status() == "cancelled"

        page.click("#requeue")  # a finished job's request again, as a new job
        page.click("#confirm")
        expect(page.locator("#note")).to_have_text(f"requeued from {job.id}")
        new_id = page.url.split("/jobs/")[1].split("?")[0]
        assert new_id != job.id and c.job(new_id).status() is not None


def test_a_script_in_a_prompt_renders_as_text_and_opens_no_dialog(stack):
    from playwright.sync_api import expect

    stack.start_worker()
    evil = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    with stack.client() as c:
        job = c.submit(evil, max_tokens=8, subscribe=False)
        c.job(job.id).result(timeout=60)
    page = stack.context.new_page()
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(f"{stack.base}/jobs/{job.id}")
    expect(page.locator("#prompt")).to_have_text(evil)
    expect(page.locator("#job")).to_have_attribute("data-done", "1")
    page.goto(f"{stack.base}/jobs?q={job.id[:8]}")
    assert page.locator("main script, main img").count() == 0
    assert dialogs == []


def test_an_action_without_the_admin_key_is_refused(stack):
    from playwright.sync_api import expect

    from mlxq.producer.gateway import ServerThread, create_app

    r = redis.Redis.from_url(stack.url)
    gk = GlobalKeys()
    apikeys.add_key(r, gk, ADMIN_KEY, "high", name="ops", admin=True)
    apikeys.add_key(r, gk, PRODUCER_KEY, "normal", name="ingest")
    with stack.client(api_key=PRODUCER_KEY) as c:
        job = c.submit("not yours to cancel", max_tokens=4, defer_s=3600, subscribe=False)
        page = stack.page(f"/jobs/{job.id}/cancel")
        page.click("#confirm")
        expect(page.locator("#message")).to_contain_text("needs an admin API key")
        assert c.job(job.id).status() == "queued"

        # a forged cross-site form: no session's CSRF token
        forged = httpx.post(f"{stack.base}/jobs/{job.id}/cancel", data={"csrf": "guess"})
        assert forged.status_code == 403 and "CSRF" in forged.text

        page.goto(f"{stack.base}/login")  # a producer's key is not an admin's
        page.fill("#api_key", PRODUCER_KEY)
        page.click("#login")
        expect(page.locator("#message")).to_contain_text("not a live admin key")
        page.fill("#api_key", ADMIN_KEY)
        page.click("#login")
        page.goto(f"{stack.base}/jobs/{job.id}/cancel")
        page.click("#confirm")
        expect(page.locator("#status")).to_have_text("cancelled")

        page.goto(f"{stack.base}/batches")
        expect(page.locator("main")).to_contain_text("No batch is running")
        page.goto(f"{stack.base}/keys")  # names, never the keys or their hashes
        expect(page.locator("#keys")).to_contain_text("ingest")
        html = page.content()
        for secret in (ADMIN_KEY, PRODUCER_KEY, apikeys.key_hash(ADMIN_KEY), apikeys.key_hash(PRODUCER_KEY)):
            assert secret not in html

    # under the gateway, every page is behind the admin login
    with ServerThread(create_app(stack.url, stack.settings)) as gateway:
        with httpx.Client(base_url=gateway) as h:
            assert h.get("/dashboard/").status_code == 401
            assert h.get("/dashboard/live/overview").status_code == 401
            login = h.get("/dashboard/login")
            token = re.search(r'name="csrf" value="([^"]+)"', login.text).group(1)
            assert h.post("/dashboard/login", data={"csrf": token, "api_key": PRODUCER_KEY}).status_code == 403
            assert h.post("/dashboard/login", data={"csrf": token, "api_key": ADMIN_KEY}).status_code == 303
            assert h.get("/dashboard/").status_code == 200
            # the gateway's own series: the API requests it answered, plotted beside the workers'
            assert h.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200
            assert wait_for(lambda: sum(h.get("/dashboard/live/gateways").json()["requests_per_min"]) > 0,
                            timeout=30, interval=0.2)

    overview = stack.page("/")  # the workers' plots, and the gateway's beside them
    expect(overview.locator('section.charts[data-model="(gateways)"] canvas')).to_have_count(2)
    expect(overview.locator(f'section.charts[data-model="{stack.tiny.name}"] canvas')).to_have_count(4)
    shot(overview, "dashboard-overview.png")
