"""The gateway's house: one Redis link, the API keys, health, metrics and errors; the API rooms.

    POST /v1/chat/completions, /v1/completions, /v1/batch/...  (chat_completions.py: OpenAI's APIs)
    POST /v1/messages, /v1/messages/count_tokens        (messages.py: Anthropic's Messages API)
    POST /v1/embeddings, /v1/batch/embeddings           (embeddings.py: OpenAI's embeddings)
    /v1/files, /v1/batches                              (files.py, batches.py: OpenAI's Batch API)
    GET  /v1/models                                     (models that live workers serve)
    GET  /metrics                                       (this gateway's request metrics)
    GET  /health                                        (liveness: no key, no Redis; always 200 while serving)
    GET  /ready                                         (Redis answers and some model has a live worker)
    /dashboard/                                         (the operator's pages, after a login with an admin key)

The bearer token is an mlxq API key: it decides the tier.  Two modes, as vLLM, ollama and mlx-lm's
server behave: while no key is registered the gateway is open (any token, e.g. the openai client's
``api_key="EMPTY"``, is normal tier; a warning is logged at start); once any key exists, an unknown
or revoked token gets 401 on every endpoint, and so does a request with no token, unless the admin
let anonymous callers in (``mlxq tiers --anonymous normal|low``).  The start-up log says which mode.
The key may come as ``x-api-key`` too, as Anthropic's clients send it.

Each request becomes one queue job through ``AsyncClient`` (``jobs.Jobs``: the same path for every
API); a stream reads the job's token channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from typing import Callable, Optional

import redis.asyncio as aredis
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from ...shared import apikeys
from ...shared.apikeys import AuthError
from ...shared.connection import RedisUnreachable, connect_async
from ...shared.slots import close_pins
from ...shared.keys import GlobalKeys
from ...shared.settings import Settings
from ..aclient import AsyncClient
from ..asubscriber import AsyncSubscriber, link_watch
from ..dashboard import create_dashboard
from ..openai_api import OpenAIError, TokenNames
from .batches import Batches
from .chat_completions import ChatCompletions
from .embeddings import Embeddings
from .files import Files
from .jobs import RETRY_AFTER_DEFAULT_S, Jobs, Refusal, bearer, live_models, unreachable_error
from .messages import Messages
from .responses import Responses
from .series import CountRequests, GatewaySeries

log = logging.getLogger("mlxq.gateway")


class GatewayMetrics:
    def __init__(self, series: Optional[GatewaySeries] = None):
        self.series = series  # the dashboard's plots (gateway/series.py)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mlxq_gateway_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        # by tier: a low-tier job waits behind the others by design, and one histogram of all tiers
        # would hide whether the interactive ones meet their target
        self.latency = Histogram("mlxq_gateway_request_seconds", "Request time to the last byte",
                                 ["endpoint", "tier"], registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.ttft = Histogram("mlxq_gateway_ttft_seconds", "Request to first streamed token", ["endpoint", "tier"],
                              registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.inflight = Gauge("mlxq_gateway_inflight_requests", "Requests being served", registry=r)
        self.tokens = Counter("mlxq_gateway_completion_tokens", "Completion tokens returned", registry=r)
        self.cancels = Counter("mlxq_gateway_disconnect_cancels",
                               "Jobs cancelled on client disconnect (or when a failed sample ended an n > 1 stream)",
                               registry=r)
        self.errors = Counter("mlxq_gateway_errors", "Error responses by type", ["type"], registry=r)
        self.keepalives = Counter("mlxq_gateway_sse_keepalives", "SSE keep-alive comments sent to streams "
                                  "waiting for their first token", registry=r)
        # who sends the load, by the key's name (`mlxq keys create --name`), never the key or its hash:
        # "anonymous" for no key, "unnamed" for a key registered without a name (the open mode's any
        # token counts as anonymous too); as few values as the operator made keys
        self.key_requests = Counter("mlxq_gateway_key_requests", "Jobs submitted, by the API key's name", ["key"],
                                    registry=r)
        # no queue depth here: it is a figure of the queue, not of this process, and every gateway (and
        # worker) exporting it would make sum() count it once per exporter; one worker per model exports
        # it (worker/metrics.py)

    def first_token(self, endpoint: str, tier: str, seconds: float) -> None:
        """A stream's first token reached its client ``seconds`` after the request came."""
        self.ttft.labels(endpoint, tier).observe(seconds)
        if self.series is not None:
            self.series.first_token(seconds)

    def served(self, endpoint: str, tier: str, started: float, tokens: int) -> None:
        """A request answered whole (not streamed): its status, latency and tokens."""
        self.tokens.inc(tokens)
        self.latency.labels(endpoint, tier).observe(time.monotonic() - started)
        self.requests.labels(endpoint, "200").inc()


class Gateway:
    """The application state: one Redis connection pool, shared by every request's AsyncClient."""

    def __init__(self, redis_url: Optional[str] = None, settings: Optional[Settings] = None):
        self.settings = settings or Settings.from_env(redis_url=redis_url)
        self.redis_url = redis_url or self.settings.redis_url
        if not self.redis_url:
            raise ValueError("mlxq gateway: no Redis URL (pass --redis-url or set MLXQ_REDIS_URL)")
        self.redis: Optional[aredis.Redis] = None
        self.series = GatewaySeries(self.settings.series_interval_s)
        self.metrics = GatewayMetrics(self.series)
        self.token_names = TokenNames()
        self._background: set[asyncio.Task] = set()
        # a finished job's result is read once more: allow for a link that drops just then
        self.result_wait_s = max(10.0, self.settings.redis_outage_s)
        # JSON carries a request in up to ~4x the bytes of its packed form (token ids as digits and
        # commas), so the body may be that much larger than the cap on the packed request.
        self.max_body_bytes = 4 * self.settings.max_prompt_bytes
        self._key_names: dict[str, tuple[float, str]] = {}  # sha256(key) -> (read at, name): key_name
        self.jobs = Jobs(self)
        self.batches = Batches(self)
        self.rooms = [ChatCompletions(self), Responses(self), Messages(self), Embeddings(self), Files(self),
                      self.batches]  # each API the gateway speaks

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        # one server, any node of a cluster or several seeds; waits up to redis_outage_s for one to answer
        self.redis = connect_async(self.redis_url, wait_s=self.settings.redis_outage_s)
        self.subscriber = AsyncSubscriber(self.redis)  # every request's stream: one pub/sub link per node
        # one log line per link state change; a request fails (503) once Redis stayed down redis_outage_s
        self.watch = link_watch("mlxq gateway", self.redis, give_up_s=self.settings.redis_outage_s)
        await self._log_auth_mode()
        self.batches.driver.start()  # OpenAI batches run with no request open (gateway/batches.py)
        plots = asyncio.get_running_loop().create_task(
            self.series.run(self.redis, GlobalKeys(self.settings.prefix).gateway_series))
        try:
            yield
        finally:
            plots.cancel()
            await asyncio.gather(plots, return_exceptions=True)
            await self.batches.driver.stop()
            if self._background:
                await asyncio.gather(*self._background, return_exceptions=True)
            await self.subscriber.aclose()
            await close_pins(self.redis)
            await self.redis.aclose()

    async def _log_auth_mode(self) -> None:
        """One line at start: open, keys required, or keys with anonymous callers let in (and at which tier)."""
        gk = GlobalKeys(self.settings.prefix)
        try:
            keys_exist = bool(await self.redis.exists(gk.api_keys))
            anonymous = await self.redis.hget(gk.policy, "anonymous")
        except Exception as exc:  # Redis not up yet: requests will say so
            log.warning("cannot read the API key registry at start: %s", exc)
            return
        mode = apikeys.auth_mode(keys_exist, anonymous)
        if keys_exist:
            log.info("auth: %s", mode)
        else:
            log.warning("auth: %s; `mlxq keys create --name NAME --tier TIER` makes a key and then requires keys",
                        mode)

    async def _authorized(self, request: Request, endpoint: str) -> Optional[Response]:
        """None when the caller may go on; a 401 response for an unknown or revoked key."""
        try:
            await self.client(request).tier()
        except AuthError as exc:
            return self.error(endpoint, OpenAIError(401, str(exc), "authentication_error", code="invalid_api_key"))
        return None

    KEY_NAME_TTL_S = 60.0  # a renamed or new key shows under its name within this long

    async def key_name(self, api_key: Optional[str]) -> str:
        """The metrics label of a submitting caller's key: its name, read from the key registry's
        info once a minute per key (a request costs no extra Redis read in between)."""
        if not api_key:
            return "anonymous"
        h = apikeys.key_hash(api_key)
        now = time.monotonic()
        cached = self._key_names.get(h)
        if cached is not None and now - cached[0] < self.KEY_NAME_TTL_S:
            return cached[1]
        try:
            raw = await self.redis.hget(GlobalKeys(self.settings.prefix).api_key_info, h)
        except Exception:  # noqa: BLE001 - a label is not worth failing a request the key check passed
            return cached[1] if cached else "unnamed"
        if raw is None:  # open mode: any token is served, and it names no registered key
            name = "anonymous" if not await self.redis.exists(GlobalKeys(self.settings.prefix).api_keys) else "unnamed"
        else:
            name = apikeys.key_label(raw)
        if len(self._key_names) > 10_000:  # tokens sent in open mode are not keys: keep no unbounded map
            self._key_names.clear()
        self._key_names[h] = (now, name)
        return name

    def client(self, request: Request) -> AsyncClient:
        return AsyncClient(api_key=bearer(request), settings=self.settings, redis_client=self.redis,
                           subscriber=self.subscriber, watch=self.watch)

    def spawn(self, coro) -> None:
        """Run a coroutine outside the request's task (which may be being cancelled)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- endpoints -------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        denied = await self._authorized(request, "/v1/models")
        if denied is not None:
            return denied
        models = live_models(await self.client(request).models(), self.settings.live_worker_s)
        data = [{"id": name, "object": "model", "created": int(info.get("created", 0) or 0), "owned_by": "mlxq",
                 "context_length": info.get("context_length")} for name, info in sorted(models.items())]
        self.metrics.requests.labels("/v1/models", "200").inc()
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        """Liveness: the process serves HTTP.  No key and no Redis: an orchestrator restarts a gateway
        whose /health fails, and restarting one because Redis is down cures nothing (/ready says that)."""
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """Readiness: Redis answers within ``ready_timeout_s`` and some model has a live worker (a
        heartbeat that still vouches for it).  503 otherwise, with the reason in the body.  No key: a
        probe carries none, so the body names no model."""
        timeout = self.settings.ready_timeout_s
        try:
            models, live = await asyncio.wait_for(self._live_workers(), timeout)
        except asyncio.TimeoutError:
            return self._not_ready(f"Redis did not answer within {timeout:g}s", redis="timeout")
        except Exception as exc:  # noqa: BLE001 - whatever the link says, the answer is "not ready, why"
            return self._not_ready(f"Redis is unreachable: {type(exc).__name__}: {exc}", redis="unreachable")
        body = {"redis": "ok", "models": models, "live_workers": live}
        if not live:
            why = "no model is registered" if not models else f"no live worker for any of {models} models"
            return self._not_ready(why, **body)
        return JSONResponse({"status": "ready", **body})

    async def _live_workers(self) -> tuple[int, int]:
        """(registered models, workers whose heartbeat vouches for them now), read without retries: a
        probe wants the answer now, not one after ``redis_outage_s``.  Heartbeats are in server time
        (``beats``: worker -> the time until which its last beat vouches for it; a stuck worker's is 0)."""
        client = AsyncClient(settings=self.settings, redis_client=self.redis, subscriber=self.subscriber,
                             watch=self.watch)
        await self.redis.ping()
        gk = client.gkeys
        models = await client.at(gk.models).hkeys(gk.models)
        live = 0
        for name in models:
            beats = gk.model_keys(name.decode() if isinstance(name, bytes) else name).beats
            r = client.at(beats)
            sec, usec = await r.time()
            live += await r.zcount(beats, f"({sec + usec / 1e6}", "+inf")
        return len(models), live

    def _not_ready(self, reason: str, **fields) -> JSONResponse:
        log.debug("/ready 503: %s", reason)  # (a probe asks every few seconds: the body says why)
        return JSONResponse({"status": "not ready", "reason": reason, **fields}, status_code=503,
                            headers={"Retry-After": str(max(1, math.ceil(self.settings.ready_timeout_s)))})

    async def prometheus(self, request: Request) -> Response:
        denied = await self._authorized(request, "/metrics")
        if denied is not None:
            return denied
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def error(self, endpoint: str, exc: OpenAIError, retry_after: Optional[float] = None,
              shape: Callable[[OpenAIError], dict] = OpenAIError.body) -> JSONResponse:
        """An error response in ``shape`` (an API's error body; OpenAI's by default); every 429 and 503
        says when to come back (``Retry-After``, seconds)."""
        self.metrics.requests.labels(endpoint, str(exc.status)).inc()
        self.metrics.errors.labels(exc.type).inc()
        log.info("%s %d %s: %s", endpoint, exc.status, exc.type, exc.message)
        headers = getattr(exc, "headers", None)  # an error that knows its own Retry-After
        if headers is None and exc.status in (429, 503):
            wait = retry_after if retry_after is not None else RETRY_AFTER_DEFAULT_S
            headers = {"Retry-After": str(max(1, math.ceil(wait)))}
        return JSONResponse(shape(exc), status_code=exc.status, headers=headers)

    def refused(self, endpoint: str, refusal: Refusal,
                shape: Callable[[OpenAIError], dict] = OpenAIError.body) -> Response:
        """A request that was not queued: its error, or a 499 for a client that left while its body was
        still coming."""
        if refusal.gone:
            self.metrics.requests.labels(endpoint, "499").inc()
            return Response(status_code=499)
        return self.error(endpoint, refusal.error, refusal.retry_after, shape)

    def shape_of(self, path: str) -> Callable[[OpenAIError], dict]:
        """The error body of the API ``path`` belongs to: a room's own (``error_shape``), else OpenAI's."""
        shapes = (getattr(room, "error_shape", lambda p: None)(path) for room in self.rooms)
        return next((shape for shape in shapes if shape is not None), OpenAIError.body)

    async def unreachable(self, request: Request, exc: RedisUnreachable) -> Response:
        """Any endpoint, when Redis stayed unreachable past ``redis_outage_s``: 503 + Retry-After."""
        return self.error(request.url.path, unreachable_error(exc), shape=self.shape_of(request.url.path))

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        """A path no route serves (404) or a method it does not take (405), in the error shape of the API
        the path belongs to (Starlette's own answer is plain text, which no API's client reads as an error)."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", param=None, code=code)
        # a 404's path is whatever was asked for: one metrics label for all of them
        response = self.error("(no route)" if exc.status_code == 404 else request.url.path, err,
                              shape=self.shape_of(request.url.path))
        response.headers.update(exc.headers or {})
        return response

    async def internal_error(self, request: Request, exc: Exception) -> Response:
        """What no handler caught: a 500 in its API's error shape (Starlette logs the traceback)."""
        return self.error(request.url.path, OpenAIError(500, f"internal error: {type(exc).__name__}",
                                                         "server_error", code="internal_error"),
                          shape=self.shape_of(request.url.path))


def create_app(redis_url: Optional[str] = None, settings: Optional[Settings] = None) -> Starlette:
    gw = Gateway(redis_url, settings)
    routes = [
        Route("/v1/models", gw.models, methods=["GET"]),
        *(route for room in gw.rooms for route in room.routes()),
        Route("/metrics", gw.prometheus, methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/ready", gw.ready, methods=["GET"]),
        # the operator's pages, behind a login with an admin key (producer/dashboard)
        Mount("/dashboard", app=create_dashboard(gw.redis_url, gw.settings, login_required=True)),
    ]
    handlers = {RedisUnreachable: gw.unreachable, HTTPException: gw.http_error, Exception: gw.internal_error}
    app = Starlette(routes=routes, lifespan=gw.lifespan, exception_handlers=handlers,
                    middleware=[Middleware(CountRequests, series_=gw.series)])
    app.state.gateway = gw
    return app


class ServerThread:
    """Uvicorn serving an app on a thread (tests, notebooks): ``with ServerThread(app) as url: ...``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        end = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > end or not self.thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
