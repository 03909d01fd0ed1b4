"""The dashboard's HTTP side: pages, their live parts, sessions, and the actions behind the admin key.

    GET  /                      overview: models and workers (live), the last hour's plots
    GET  /jobs                  jobs by status, model, tier, key name, text;   GET /jobs/{id}: one job, live
    GET  /batches, /keys        batch progress; keys' usage, quota, jobs in flight
    GET  /jobs/{id}/cancel ...  a confirmation page; its form POSTs the action
    POST /jobs/{id}/cancel, /jobs/{id}/requeue, /failed/purge, /failed/requeue
    GET|POST /login, POST /logout
    GET  /live/overview, /live/series/{model}, /live/gateways, /live/jobs/{id}   what the pages poll (once
                                a second at most)

Sessions: a random id in an HttpOnly, SameSite=Strict cookie names a server-side session, which holds
its CSRF token and, after a login, the operator's key (never sent back, never shown). Every action is
a POST whose form carries the session's CSRF token, and whose Origin (when the browser sends one) is
this server's. ``login_required``: every page but the login needs a session whose key is a live admin
key, checked at each request (a revoked key is out at once); that is how the gateway mounts it, and how
``mlxq dashboard`` runs when bound beyond loopback. Otherwise pages are open to whoever reaches the
loopback port, and the actions need an admin key as the CLI's do (none in open mode, where no key exists).

The Redis client is synchronous (producer/admin.py is shared with the CLI): Starlette runs the plain
``def`` endpoints on its thread pool.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from urllib.parse import quote, urlencode, urlparse

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ...shared import apikeys
from ...shared.apikeys import AuthError
from ...shared.connection import connect
from ...shared.keys import GlobalKeys
from ...shared.settings import TIERS, Settings
from ..admin import STATUSES, Admin
from . import views

log = logging.getLogger("mlxq.dashboard")
HERE = Path(__file__).parent
COOKIE = "mlxq_dashboard"
SESSION_S = 12 * 3600.0
MAX_SESSIONS = 10_000  # sessions cost memory: the oldest go first past this
POLL_MS = 1000  # the live parts poll at most once a second


@dataclass
class Session:
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    api_key: Optional[str] = None  # the operator's key after a login: used for actions, never rendered
    key_name: Optional[str] = None
    expires: float = field(default_factory=lambda: time.monotonic() + SESSION_S)


class Sessions:
    def __init__(self):
        self._lock = threading.Lock()
        self._by_id: dict[str, Session] = {}

    def get(self, sid: Optional[str]) -> Optional[Session]:
        with self._lock:
            s = self._by_id.get(sid or "")
            if s is not None and s.expires < time.monotonic():
                del self._by_id[sid]
                return None
            return s

    def new(self) -> tuple[str, Session]:
        sid, s = secrets.token_urlsafe(32), Session()
        with self._lock:
            if len(self._by_id) >= MAX_SESSIONS:
                for old in sorted(self._by_id, key=lambda k: self._by_id[k].expires)[: MAX_SESSIONS // 10]:
                    del self._by_id[old]
            self._by_id[sid] = s
        return sid, s

    def drop(self, sid: Optional[str]) -> None:
        with self._lock:
            self._by_id.pop(sid or "", None)


class Dashboard:
    def __init__(self, redis_url: Optional[str] = None, settings: Optional[Settings] = None,
                 login_required: bool = False, title: str = "mlxq"):
        self.settings = settings or Settings.from_env(redis_url=redis_url)
        self.redis_url = redis_url or self.settings.redis_url
        if not self.redis_url:
            raise ValueError("mlxq dashboard: no Redis URL (pass --redis-url or set MLXQ_REDIS_URL)")
        self.login_required = login_required
        self.title = title
        self.prefix = self.settings.prefix
        self.gk = GlobalKeys(self.prefix)
        self._redis = None
        self._redis_lock = threading.Lock()
        self.sessions = Sessions()
        self.env = Environment(loader=FileSystemLoader(HERE / "templates"),
                               autoescape=select_autoescape(default=True, default_for_string=True))
        self.env.filters["age"] = _age
        self.env.filters["num"] = _num

    @property
    def r(self):
        """One connection pool, made at the first request (a mounted app runs no lifespan of its own)."""
        with self._redis_lock:
            if self._redis is None:
                self._redis = connect(self.redis_url, wait_s=self.settings.redis_outage_s)
            return self._redis

    # -- sessions, auth, CSRF ----------------------------------------------------------------
    def session(self, request: Request) -> tuple[Optional[str], Optional[Session]]:
        sid = request.cookies.get(COOKIE)
        return sid, self.sessions.get(sid)

    def admin_ok(self, s: Optional[Session]) -> bool:
        return s is not None and apikeys.is_admin(self.r, self.gk, s.api_key)

    def admin(self, s: Optional[Session]) -> Admin:
        return Admin(self.r, self.settings, s.api_key if s is not None else None)

    def page(self, request: Request, template: str, status_code: int = 200, **ctx) -> Response:
        """A page, with a session made for a visitor who has none (its cookie set)."""
        sid, s = self.session(request)
        fresh = s is None
        if fresh:
            sid, s = self.sessions.new()
        base = request.scope.get("root_path", "")
        body = self.env.get_template(template).render(
            base=base, title=self.title, csrf=s.csrf, who=s.key_name, login_required=self.login_required,
            poll_ms=POLL_MS, tiers=TIERS, **ctx)
        response = HTMLResponse(body, status_code=status_code)
        response.headers["Content-Security-Policy"] = ("default-src 'self'; script-src 'self'; style-src 'self'; "
                                                       "img-src 'self' data:; frame-ancestors 'none'")
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        if fresh:
            response.set_cookie(COOKIE, sid, max_age=int(SESSION_S), httponly=True, samesite="strict",
                                path=base or "/", secure=request.url.scheme == "https")
        return response

    def gate(self, request: Request) -> Optional[Response]:
        """None when the visitor may see the pages; else the login page (or a 401 for the live parts)."""
        if not self.login_required or self.admin_ok(self.session(request)[1]):
            return None
        if request.url.path.startswith(request.scope.get("root_path", "") + "/live/"):
            return JSONResponse({"error": "log in with an admin key"}, status_code=401)
        return self.page(request, "login.html", status_code=401, message=None)

    async def checked_form(self, request: Request) -> tuple[Optional[Session], dict, Optional[Response]]:
        """The form of an action and its session; a 403 page when the CSRF token or the Origin is wrong."""
        form = dict(await request.form())
        _, s = self.session(request)
        origin = request.headers.get("origin")
        if origin and origin != "null" and urlparse(origin).netloc != request.headers.get("host"):
            return s, form, self.refused(request, "refused: the request came from another site")
        token = form.get("csrf", "")
        if s is None or not isinstance(token, str) or not hmac.compare_digest(token, s.csrf):
            return s, form, self.refused(request, "refused: the form's CSRF token does not match this session "
                                                  "(reload the page and try again)")
        return s, form, None

    def refused(self, request: Request, message: str, status_code: int = 403) -> Response:
        return self.page(request, "message.html", status_code=status_code, heading="Refused", message=message)

    # -- pages -----------------------------------------------------------------------------
    def overview(self, request: Request) -> Response:
        return self.gate(request) or self.page(request, "overview.html", **views.overview(self.r, self.prefix))

    def jobs(self, request: Request) -> Response:
        denied = self.gate(request)
        if denied is not None:
            return denied
        q = request.query_params
        status = q.get("status") or ""
        admin = self.admin(None)
        found = admin.search(statuses=(status,) if status in STATUSES else STATUSES, queue=q.get("model") or None,
                             tier=q.get("tier") or None, key=q.get("key") or None, text=q.get("q") or None,
                             limit=_int(q.get("limit"), 100))
        return self.page(request, "jobs.html", rows=found, models=admin.queues(), statuses=STATUSES,
                         query={k: q.get(k) or "" for k in ("status", "model", "tier", "key", "q")}, now=time.time())

    def job(self, request: Request) -> Response:
        denied = self.gate(request)
        if denied is not None:
            return denied
        job_id = request.path_params["job_id"]
        try:
            info = views.job_page(self.admin(None), job_id)
        except ValueError as exc:
            return self.page(request, "message.html", status_code=404, heading="No such job", message=str(exc))
        return self.page(request, "job.html", job=info, note=request.query_params.get("note"))

    def batches(self, request: Request) -> Response:
        return self.gate(request) or self.page(request, "batches.html", batches=views.batches(self.r, self.prefix))

    def keys(self, request: Request) -> Response:
        return self.gate(request) or self.page(request, "keys.html", keys=views.keys(self.r, self.prefix))

    # -- live parts --------------------------------------------------------------------------
    def live_overview(self, request: Request) -> Response:
        """The overview's tables as an HTML fragment (autoescaped like the page), polled by the page."""
        denied = self.gate(request)
        if denied is not None:
            return denied
        body = self.env.get_template("_overview.html").render(base=request.scope.get("root_path", ""),
                                                              tiers=TIERS, **views.overview(self.r, self.prefix))
        return HTMLResponse(body)

    def live_series(self, request: Request) -> Response:
        return self.gate(request) or JSONResponse(views.chart(self.r, self.prefix, request.path_params["model"]))

    def live_gateways(self, request: Request) -> Response:
        return self.gate(request) or JSONResponse(views.gateway_chart(self.r, self.prefix))

    def live_job(self, request: Request) -> Response:
        denied = self.gate(request)
        if denied is not None:
            return denied
        try:
            return JSONResponse(views.job_live(self.admin(None), request.path_params["job_id"]))
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)

    # -- actions ---------------------------------------------------------------------------
    ACTIONS = {"cancel": "Cancel job {id}?", "requeue": "Run job {id}'s request again, as a new job?"}

    def confirm(self, request: Request) -> Response:
        """GET of an action: what it will do, and a form that does it."""
        denied = self.gate(request)
        if denied is not None:
            return denied
        action, job_id = request.path_params.get("action", "purge"), request.path_params.get("job_id")
        if job_id is not None and action not in self.ACTIONS:
            return self.page(request, "message.html", status_code=404, heading="Not found",
                             message=f"no action {action!r}: cancel or requeue")
        if job_id is None:
            question = "Empty the dead-letter set of every queue? The failed jobs' records go with it."
            target = "/failed/purge"
        else:
            question, target = self.ACTIONS[action].format(id=job_id), f"/jobs/{quote(job_id)}/{action}"
        return self.page(request, "confirm.html", question=question, target=target, job_id=job_id)

    async def act(self, request: Request) -> Response:
        """POST of an action: CSRF and admin key checked, then the same call as the CLI's."""
        denied = await _threaded(self.gate, request)  # (Redis reads: off the event loop, as every one here)
        if denied is not None:
            return denied
        s, _form, bad = await self.checked_form(request)
        if bad is not None:
            return bad
        action, job_id = request.path_params.get("action", "purge"), request.path_params.get("job_id")
        if job_id is not None and action not in self.ACTIONS:
            return self.refused(request, f"no action {action!r}: cancel or requeue", status_code=404)
        admin, base = await _threaded(self.admin, s), request.scope.get("root_path", "")
        try:
            if job_id is None:
                gone = await _threaded(admin.purge_failed)
                note = f"purged {sum(gone.values())} failed job(s)"
                return RedirectResponse(f"{base}/jobs?" + urlencode({"status": "failed", "note": note}), 303)
            if action == "cancel":
                note = await _threaded(admin.cancel, job_id)
                return RedirectResponse(f"{base}/jobs/{quote(job_id)}?" + urlencode({"note": note}), 303)
            new_id = await _threaded(admin.requeue, job_id)
            return RedirectResponse(f"{base}/jobs/{quote(new_id)}?" + urlencode({"note": f"requeued from {job_id}"}),
                                    303)
        except AuthError as exc:
            return self.refused(request, str(exc))
        except ValueError as exc:
            return self.refused(request, str(exc), status_code=409)

    async def login(self, request: Request) -> Response:
        if request.method == "GET":
            return self.page(request, "login.html", message=None)
        s, form, bad = await self.checked_form(request)
        if bad is not None:
            return bad
        key = form.get("api_key") if isinstance(form.get("api_key"), str) else ""
        if not await _threaded(lambda: apikeys.is_admin(self.r, self.gk, key.strip())):
            return self.page(request, "login.html", status_code=403,
                             message="refused: that is not a live admin key (`mlxq keys create --admin` makes one)")
        s.api_key = key.strip()
        info = await _threaded(lambda: self.r.hget(self.gk.api_key_info, apikeys.key_hash(s.api_key)))
        s.key_name = apikeys.key_label(info or b"{}")
        return RedirectResponse(f"{request.scope.get('root_path', '')}/", 303)

    async def logout(self, request: Request) -> Response:
        sid, _ = self.session(request)
        _, _, bad = await self.checked_form(request)
        if bad is not None:
            return bad
        self.sessions.drop(sid)
        response = RedirectResponse(f"{request.scope.get('root_path', '')}/login", 303)
        response.delete_cookie(COOKIE, path=request.scope.get("root_path", "") or "/")
        return response

    def routes(self) -> list:
        return [
            Route("/", self.overview), Route("/jobs", self.jobs), Route("/jobs/{job_id}", self.job),
            Route("/jobs/{job_id}/{action:str}", self.confirm, methods=["GET"]),
            Route("/jobs/{job_id}/{action:str}", self.act, methods=["POST"]),
            Route("/failed/purge", self.confirm, methods=["GET"]), Route("/failed/purge", self.act, methods=["POST"]),
            Route("/batches", self.batches), Route("/keys", self.keys),
            Route("/live/overview", self.live_overview), Route("/live/series/{model}", self.live_series),
            Route("/live/gateways", self.live_gateways), Route("/live/jobs/{job_id}", self.live_job),
            Route("/login", self.login, methods=["GET", "POST"]), Route("/logout", self.logout, methods=["POST"]),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]


def create_dashboard(redis_url: Optional[str] = None, settings: Optional[Settings] = None,
                     login_required: bool = False) -> Starlette:
    dash = Dashboard(redis_url, settings, login_required)
    app = Starlette(routes=dash.routes())
    app.state.dashboard = dash
    return app


async def _threaded(fn, *args):
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)


def _int(x, default: int) -> int:
    try:
        return max(1, min(1000, int(x)))
    except (TypeError, ValueError):
        return default


def _age(s) -> str:
    if s is None:
        return "-"
    s = max(0.0, float(s))
    return f"{s:.1f}s" if s < 10 else f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h"


def _num(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)
