"""Bulk submission at the low tier: ``mlxq batch IN.jsonl -o OUT.jsonl`` (``Client.map``: ``bulkmap``).

Input lines are JSON: a string (the prompt), an object with one of ``prompt`` / ``messages`` /
``prompt_tokens`` plus sampling params (``max_tokens``, ``temperature``, ...) and an optional
``custom_id``, or an OpenAI Batch request line (``{"custom_id", "method": "POST", "url":
"/v1/chat/completions" | "/v1/completions" | "/v1/embeddings", "body": {...}}``).  A line is one job,
so an embeddings line's ``input`` is one input (a string or one list of token ids): a line with more
is refused, naming it.

Output lines follow OpenAI's Batch output format, plus the input's ``line`` number; they are written
as jobs finish (any order)::

    {"id": <job id>, "custom_id": ..., "line": 3,
     "response": {"status_code": 200, "request_id": <job id>,
                  "body": <an embeddings line: OpenAI's embeddings response, ``object`` "list", its
                           one embedding as floats, usage; else a chat.completion or text_completion
                           object: choices (n of them for a
                           line with "n"), each with its finish_reason and, for a line that
                           asks for them, its logprobs (as the gateway returns them),
                           usage (with prompt_tokens_details.cached_tokens), and mlxq's "stats">},
     "error": null}

A job that failed has ``status_code`` 400 (the request can never run) or 500 and an OpenAI error
``body``; a line that could not be submitted at all has ``"response": null`` and
``"error": {"code", "message"}``.

Structured output: run-wide options (``mlxq batch --json-schema FILE``, ``--regex``, ``--tools``...,
or ``Client.map(items, response_format=...)``) are defaults that a line overrides with its own
``response_format`` / ``tools`` / ``tool_choice`` / penalties (``"response_format": {"type": "text"}``
or ``null``: no constraint for that line).  The run-wide options are checked once, before anything
is queued: a bad one refuses the whole run.  A line whose own constraint is bad is reported on that
line (a ``refused_line``, like any line that cannot run) and the other lines run: one bad line of
10,000 does not hold up the rest, and its line number says which to fix.  Identical constraints cost
one grammar compile (the grammar engine caches them).

Resuming: a line's idempotency key is ``batch:<sha256 of the input file>:<sha256 of the run's
options>:<line>``.  A rerun with the same options skips lines already in the output and re-submits
the rest with the same keys, so a job submitted before the interruption is waited for, not run again
(within the idempotency TTL, 24 h by default); a run with other options runs every line anew.  A
line whose job was cancelled is written as an error (code ``cancelled``); like any line in the
output, a rerun skips it: delete its output line to run it again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Optional

from ..shared.schemas import INVALID_REQUEST, Result
from ..shared.genopts import check_defaults, error_text
from ..shared.steps import run_steps
from .bulkmap import BULK_TIER_FLOOR, Line, RunWebhook, _sync_io, as_params, reap_lines, submit_with_backoff

log = logging.getLogger(__name__)

OPENAI_BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# run-wide options (mlxq batch --json-schema, --tools...) that a line's explicit null turns off
CLEARABLE = frozenset({"response_format", "tools", "tool_choice"})
Kind = Literal["chat", "text", "embed"]  # what a line's job answers: a chat.completion, a text_completion, embeddings
KINDS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "text", "/v1/embeddings": "embed"}


def _embedding_params(body: Any) -> tuple[dict, int]:
    """(submit arguments, 0) of an OpenAI Batch /v1/embeddings line's ``body``: one job, so one input."""
    from .core import embed_inputs, embed_kwargs
    from .openai_embeddings import EmbeddingRequest

    try:
        req = EmbeddingRequest.model_validate(body)
    except ValueError as exc:  # (a pydantic ValidationError: the first problem, in one line)
        raise ValueError(error_text(exc)) from None
    if req.count() != 1:
        raise ValueError(f"input holds {req.count()} inputs: a batch line is one job, so one input "
                         "(a string or one list of token ids); put each input on a line of its own")
    if req.encoding_format != "float":
        raise ValueError("encoding_format must be float in a batch line (the output file holds the values as "
                         "numbers)")
    items, _ = embed_inputs(req.input)
    params = {**items[0], **embed_kwargs(req.dimensions, req.pooling, True)}
    if req.model:
        params["model"] = req.model
    return params, 0


def _line_params(item: Any) -> tuple[dict, dict, Optional[str], Kind, int]:
    """(submit arguments, endpoint defaults, custom_id, kind, top logprobs shown) of one input line;
    ValueError when it cannot run.  The endpoint defaults (``max_tokens`` 16 of a /v1/completions
    line that does not set it) give way to the run's defaults (``mlxq batch --max-tokens``)."""
    if isinstance(item, dict) and "body" in item and "url" in item:  # an OpenAI Batch request line
        from .openai_api import ChatCompletionRequest, CompletionRequest, OpenAIError

        url = item.get("url")
        if url not in OPENAI_BATCH_URLS:
            raise ValueError(f"url must be one of {OPENAI_BATCH_URLS}, got {url!r}")
        kind = KINDS[url]
        if kind == "embed":
            params, top_n = _embedding_params(item["body"])
            return params, {}, item.get("custom_id"), kind, top_n
        schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            req = schema.model_validate(item["body"])
            params = req.submit_kwargs()
        except OpenAIError as exc:
            raise ValueError(exc.message) from None
        if req.model:
            params["model"] = req.model
        for name in CLEARABLE & req.model_fields_set:  # an explicit null clears the run's option, as on
            if getattr(req, name) is None:            # a plain line (the body's own parsing drops nulls)
                params[name] = None
        fallback = {}
        if "max_tokens" not in req.model_fields_set and params.get("max_tokens") is not None:
            fallback["max_tokens"] = params.pop("max_tokens")  # CompletionRequest's default, not the line's
        return params, fallback, item.get("custom_id"), kind, req.top_n
    params = as_params(item)
    custom_id = params.pop("custom_id", None)
    kind: Kind = "chat" if params.get("messages") is not None else "text"
    return params, {}, custom_id, kind, -1  # -1: top_n is the line's logprobs


def _failure(res: Result, kind: Kind) -> Optional[tuple[int, dict]]:
    """(status, OpenAI error body) of a job that gave no answer, or None."""
    from .openai_api import failed_output

    err = failed_output(res) if kind != "embed" else (
        res if res.embedding is None and res.finish_reason != "cancelled" else None)
    if err is not None:
        status = 400 if err.error_code == INVALID_REQUEST else 500
        return status, {"error": {"message": err.error or "generation failed",
                                  "type": "invalid_request_error" if status == 400 else "server_error",
                                  "param": None, "code": err.error_code or "job_failed"}}
    if res.finish_reason == "cancelled":  # not an answer: a 200 with no text would read as one
        return 500, {"error": {"message": "the job was cancelled (mlxq cancel, or its queue purged) before it ended",
                               "type": "server_error", "param": None, "code": "cancelled"}}
    return None


def batch_line(n: int, custom_id: Optional[str], job_id: str, model: str, kind: Kind, res: Result,
               fmt=None) -> dict:
    """One output line in OpenAI's Batch output format (plus ``line``): the body the gateway would
    answer, logprobs included (``fmt``: a ``LogprobFormatter``; token ids as ``"<id>"`` without one)."""
    from .openai_api import LogprobFormatter, choice, usage
    from .openai_embeddings import embeddings_body

    if fmt is None:
        fmt = LogprobFormatter(lambda i: f"<{i}>", 0)

    failed = _failure(res, kind)
    if failed is not None:
        status, body = failed
    elif kind == "embed":
        status, body = 200, embeddings_body("float", model, [res])
    else:
        chat = kind == "chat"
        status = 200
        body = {"id": ("chatcmpl-" if chat else "cmpl-") + job_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(res.stats.finished_at or time.time()), "model": model,
                "choices": [choice(chat, out, fmt) for out in res.outputs],
                "usage": usage(res), "stats": res.stats.model_dump()}
    return {"id": job_id, "custom_id": custom_id, "line": n,
            "response": {"status_code": status, "request_id": job_id, "body": body}, "error": None}


def refused_line(n: int, custom_id: Optional[str], message: str, code: str = "invalid_request") -> dict:
    return {"id": None, "custom_id": custom_id, "line": n, "response": None,
            "error": {"code": code, "message": message}}


# -- mlxq batch ------------------------------------------------------------------------------------

@dataclass
class BatchSummary:
    total: int
    skipped: int  # already in the output
    written: int  # written by this run
    duplicates: int  # submissions that found the job of an earlier run
    interrupted: bool


def file_identity(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:24]


def finished_lines(output_path: str) -> set[int]:
    """Line numbers already in the output; a torn last line (an interrupted write) is cut off."""
    if not os.path.exists(output_path):
        return set()
    with open(output_path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
            data = data[: data.rfind(b"\n") + 1]
    done = set()
    for raw in data.splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("line"), int) and (
                rec.get("response") or rec.get("error") or rec.get("finish_reason")):  # (older format too)
            done.add(rec["line"])
    return done


class BatchRun:
    """One pass over an input file; ``run()`` returns when every line is in the output or ``stop`` is set."""

    def __init__(self, client, input_path: str, output_path: str, *, window: int = 256, poll_s: float = 0.05,
                 progress: bool = True, stop: Optional[threading.Event] = None, webhook: Optional[str] = None,
                 **defaults: Any):
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.client = client
        self.input_path, self.output_path = input_path, output_path
        self.window, self.poll_s, self.progress = window, poll_s, progress
        self.stop = stop or threading.Event()
        self.defaults = defaults
        self.webhook = webhook  # one POST when every line is in the output (not per line; none if interrupted)
        self._names: dict[str, Any] = {}  # model -> token id -> text, as the gateway shows them
        self._token_names = None  # an openai_api.TokenNames, made on the first line with logprobs

    def _formatter(self, model: str, top_n: int):
        """The job's logprobs formatter: token texts from the model's tokenizer.json when its directory
        is readable here (the registry's ``source``), as the gateway does; otherwise ``"<id>"``."""
        from .openai_api import LogprobFormatter, TokenNames

        if model not in self._names:
            if self._token_names is None:
                self._token_names = TokenNames()
            self._names[model] = self._token_names.for_model(self.client.model_info(model))
        return LogprobFormatter(self._names[model], top_n)

    def _lines(self, skip: set[int]) -> Iterator[tuple[int, bytes]]:
        """The lines to run, as bytes: each decoded on its own, so a line that is not UTF-8 is refused
        alone (read as text, it ended the whole run before anything was queued)."""
        with open(self.input_path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                if raw.strip() and n not in skip:
                    yield n, raw

    def _key_prefix(self, ident: str) -> str:
        """The idempotency key prefix of this run's lines: the input file and the run's options, so a
        resumed run finds its jobs again and a run with other options (--max-tokens, a schema...) gets
        new ones, where it got the earlier run's results (each model's keys are its own already)."""
        options = json.dumps(self.defaults, sort_keys=True, default=repr, separators=(",", ":"))
        return f"batch:{ident}:{hashlib.sha256(options.encode()).hexdigest()[:12]}"

    def run(self) -> BatchSummary:
        from tqdm import tqdm

        check_defaults(self.defaults)
        if self.webhook is not None:
            from .webhooks import check_url

            check_url(self.webhook, self.client.settings)
        prefix = self._key_prefix(file_identity(self.input_path))
        done = finished_lines(self.output_path)
        with open(self.input_path, "rb") as f:
            total = sum(1 for raw in f if raw.strip())
        tier = self.client.tier(BULK_TIER_FLOOR)
        bar = tqdm(total=total, initial=len(done), unit="line", disable=not self.progress, dynamic_ncols=True)
        summary = BatchSummary(total=total, skipped=len(done), written=0, duplicates=0, interrupted=False)
        inflight: dict[str, Line] = {}  # job id -> its line
        lines = self._lines(done)
        exhausted = False
        with open(self.output_path, "a", encoding="utf-8") as out:
            try:
                while not self.stop.is_set():
                    while not exhausted and len(inflight) < self.window and not self.stop.is_set():
                        nxt = next(lines, None)
                        if nxt is None:
                            exhausted = True
                            break
                        n, raw = nxt
                        self._submit(n, raw, prefix, tier, inflight, out, summary, bar)
                    if exhausted and not inflight:
                        break
                    if not self._reap(inflight, out, summary, bar):
                        self.stop.wait(self.poll_s)
            except KeyboardInterrupt:
                self.stop.set()
            finally:
                bar.close()
        summary.interrupted = self.stop.is_set() and (not exhausted or bool(inflight))
        if self.webhook is not None and not summary.interrupted:
            self._announce(total)
        return summary

    def _announce(self, total: int) -> None:
        """``bulk.completed`` for the sender, counted over the whole output (earlier runs' lines too)."""
        hook = RunWebhook("bulk", self.webhook)
        with open(self.output_path, "rb") as f:
            for raw in f:
                try:
                    rec = json.loads(raw)
                except ValueError:  # (not a line this command wrote)
                    continue
                ok = isinstance(rec, dict) and (rec.get("response") or {}).get("status_code") == 200
                hook.completed, hook.failed = hook.completed + ok, hook.failed + (not ok)
        run_steps(hook.end("completed", self.client.gkeys, self.client.key_hash, total,
                           output=os.path.basename(self.output_path)), _sync_io(self.client))

    def _submit(self, n, raw, prefix, tier, inflight, out, summary, bar) -> None:
        custom_id = None
        try:
            item = json.loads(raw)  # bytes: UTF-8 or a UnicodeDecodeError (a ValueError): this line refused
            custom_id = item.get("custom_id") if isinstance(item, dict) else None
            params, fallback, custom_id, kind, top_n = _line_params(item)
            params = {**fallback, **self.defaults, **params}
            sub = submit_with_backoff(self.client, params, tier, f"{prefix}:{n}", self.stop)
        except ValueError as exc:
            self._write(out, refused_line(n, custom_id, f"invalid request: {error_text(exc)}"), summary, bar)
            return
        if sub is None:  # stopped while the queue was full
            return
        summary.duplicates += sub.duplicate
        if top_n < 0:  # a plain line: its logprobs k (validated by the submit) is the alternatives shown
            top_n = int(params.get("logprobs") or 0)
        inflight[sub.job_id] = Line(n, custom_id, kind, top_n, sub)

    def _reap(self, inflight, out, summary, bar) -> bool:
        if not inflight:
            return False
        ended = run_steps(reap_lines(inflight, self.client.gkeys), _sync_io(self.client))
        for line, job_id, res in ended:
            model = line.sub.model
            fmt = (self._formatter(model, line.top_n)
                   if any(o.logprobs is not None for o in res.outputs) or line.top_n else None)
            self._write(out, batch_line(line.n, line.custom_id, job_id, model, line.kind, res, fmt), summary, bar)
        return bool(ended)

    @staticmethod
    def _write(out, record: dict, summary: BatchSummary, bar) -> None:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
        out.flush()
        summary.written += 1
        bar.update(1)
