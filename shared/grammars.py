"""A request's output grammar and its checks before queueing: a ``response_format``
(:mod:`mlxq.shared.constraints`) or tool calls (:mod:`mlxq.shared.tools`).

This module imports both; they import only downward (tools builds on constraints), so neither
needs to import the other at run time.
"""

from __future__ import annotations

from typing import Optional

from . import constraints, tools
from .constraints import ModelFormat


def check_request(req) -> None:
    """Refuse (a ConstraintError, one line) a request whose constraint cannot compile: its
    response_format, and its tools (:func:`mlxq.shared.tools.check_tools`, no model format)."""
    constraints.compile_format(req.response_format)
    if req.tools:
        tools.check_tools(req)


def grammar_for(req, fmt: Optional[ModelFormat] = None) -> Optional[str]:
    """The grammar a job's output follows (None: free text), for a model whose format is ``fmt``:
    its tool calls' (``tools`` given, ``tool_choice`` not "none"), else its response_format's."""
    fmt = fmt or ModelFormat()
    if tools.uses_tools(req):
        return tools.tool_grammar(req, fmt)
    return constraints.grammar_for(req, fmt)
