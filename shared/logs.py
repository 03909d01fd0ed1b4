"""How every mlxq process writes its log: text, or one JSON object per line (``--log-format json``,
``MLXQ_LOG_FORMAT``), one implementation for the worker, the gateway and the CLI's other commands.

A JSON line has ``ts`` (Unix seconds), ``level``, ``logger`` and ``message``, plus ``job`` and
``attempt`` when the line is about a job, and ``exc`` with the traceback of a logged exception.  A
line is about a job when its record carries them (``extra={"job": ..., "attempt": ...}``, as the
gateway's ``jlog`` passes) or its message starts ``job=<id> attempt=<n>``, as every process's lines
about a job do: the worker's then get the same fields as the gateway's.
"""

from __future__ import annotations

import json
import logging
import re

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
RECORD_FIELDS = ("job", "attempt")  # extra fields a record may carry, copied into its JSON line
_ABOUT_JOB = re.compile(r"job=(?P<job>[0-9A-Za-z_-]+) attempt=(?P<attempt>\d+)\b")


class JsonFormatter(logging.Formatter):
    """One JSON object per line; ``job`` and ``attempt`` fields when the line is about a job."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
               "message": message}
        for key in RECORD_FIELDS:
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if "job" not in out:
            about = _ABOUT_JOB.match(message)
            if about:
                out.update(job=about["job"], attempt=int(about["attempt"]))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """The root logger at ``level``, writing to stderr as text or JSON lines (``fmt``).  Called once,
    at a process's start; uvicorn (the gateway) is run with ``log_config=None``, so its lines go
    through the same handler."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(LOG_FORMATS)}")
    logging.basicConfig(level=level.upper(), format=TEXT_FORMAT)
    if fmt == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
