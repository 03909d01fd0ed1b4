"""``mlxq gateway``: the HTTP front end, a producer in its own process.  ``app`` is the house (the
Redis link, keys, health, metrics, errors); each API it speaks is a room of its own, and every room
drives its jobs through ``jobs`` the same way."""

from ...shared.extras import GATEWAY, require

require(__name__, "gateway", GATEWAY)  # the HTTP server is an extra: say so in one line, before importing it

from .app import Gateway, ServerThread, create_app

__all__ = ["Gateway", "ServerThread", "create_app"]
