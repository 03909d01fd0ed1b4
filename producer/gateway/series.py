"""A gateway's points of the dashboard's rolling series (shared/series.py, ``GlobalKeys.gateway_series``):
the API requests it answered, those answered with a 5xx, and the time to the first streamed token as
its clients see it, written every ``series_interval_s`` by a task of its own (never on a request's path:
a request only adds to counters)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from ...shared import series

log = logging.getLogger("mlxq.gateway")


class GatewaySeries:
    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.id = f"{socket.gethostname()}-{os.getpid()}"
        self._since = time.monotonic()
        self._requests = self._errors = 0
        self._ttfts: list[float] = []

    def request(self, status: int) -> None:
        self._requests += 1
        self._errors += status >= 500

    def first_token(self, seconds: float) -> None:
        self._ttfts.append(seconds)

    def take(self) -> dict:
        """The point of the interval since the last one (its counts start again). The event loop's thread
        only, as ``request`` and ``first_token``: no lock."""
        now = time.monotonic()
        p = series.gateway_point(now - self._since, self._requests, self._errors, self._ttfts)
        self._since, self._requests, self._errors, self._ttfts = now, 0, 0, []
        return p

    async def run(self, redis, key: str) -> None:
        """Append a point every ``interval_s`` until cancelled; a Redis error skips one."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await series.append(redis, key, self.id, self.take(), time.time())
            except Exception as exc:  # noqa: BLE001 - a lost point is not worth a gateway's trouble
                log.debug("the dashboard's gateway series: a point was not written: %s", exc)


class CountRequests:
    """ASGI middleware: each API request (``/v1/...``) and its status, into the gateway's series."""

    def __init__(self, app, series_: GatewaySeries):
        self.app = app
        self.series = series_

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        status = [500]

        async def sent(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            self.series.request(status[0])
