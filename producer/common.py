"""The gateway's old import path of three names, until its split (issue 68) imports them from where they
live (``errors`` and ``registry``); then this module goes."""

from .errors import ContextLengthError, NoModelError  # noqa: F401
from .registry import has_live_worker  # noqa: F401
