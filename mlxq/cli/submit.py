"""``mlxq submit``: one prompt, its answer streamed to stdout."""

from __future__ import annotations

import json
import sys
from typing import Optional

from ..shared.schemas import DEFAULT_MAX_TOKENS
from .options import add_shared, queue_of
from .output import add_output_options, output_params


def cmd_submit(args) -> int:
    from ..producer.client import Client
    from ..producer.core import build_request

    params = dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                  stop=args.stop or None, defer_s=args.defer_s, expires_in=args.expires_in, webhook=args.webhook,
                  **output_params(args))
    if args.max_tokens is not None:  # else the request's default, which the worker fits to the context
        params["max_tokens"] = args.max_tokens
    if args.chat or "tools" in params:  # tools are rendered by the chat template
        params["messages"] = [{"role": "user", "content": args.text}]
    else:
        params["prompt"] = args.text
    queue = queue_of(args)
    build_request(queue or "-", params)  # a bad file, schema, regex...: refused before connecting
    client = Client(args.redis_url, api_key=args.api_key, model=queue)
    job = client.submit(**params)
    _say_if_no_worker(job)
    samples = params.get("n") or 1
    # several samples interleave: each is printed whole as soon as it ends, in the order they end
    parts: dict[int, list] = {}
    printed: set[int] = set()
    for delta in job.stream():
        if samples == 1:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        elif delta.sample is not None:
            parts.setdefault(delta.sample, []).append(delta)
            if delta.finish_reason:
                _print_output(_sample_output(delta.sample, parts.pop(delta.sample)), None)
                sys.stdout.flush()
                printed.add(delta.sample)
    result = job.result(timeout=60)
    for out in result.outputs:  # n == 1, and any sample the stream did not end (a failed job)
        if out.index not in printed or samples == 1:
            _print_output(out, result.text if samples == 1 else None)
    if result.finish_reason == "length" and "response_format" in params:
        limit = params.get("max_tokens", DEFAULT_MAX_TOKENS)
        print(f"mlxq submit: {CUT_SHORT} (--max-tokens {limit})", file=sys.stderr)
    if args.verbose:
        print(json.dumps(result.stats.model_dump(), indent=2), file=sys.stderr)
    return 0 if result.finish_reason != "error" else 1


def _sample_output(index: int, deltas: list):
    """A sample's output from its streamed deltas (text, tool calls, how it ended)."""
    from ..shared.schemas import SampleOutput

    calls = [c for d in deltas for c in (d.tool_calls or [])]
    last = deltas[-1]
    return SampleOutput(index=index, text="".join(d.text for d in deltas), finish_reason=last.finish_reason,
                        error=last.error, tool_calls=calls or None)


def _print_output(out, streamed: Optional[str]) -> None:
    """One sample's output (its text unless it was ``streamed``), its tool calls and its error."""
    if streamed is None:
        print(f"--- sample {out.index} ({out.finish_reason}) ---")
        sys.stdout.write(out.text)
    sys.stdout.write("\n")
    if out.tool_calls:  # one JSON line: [{"id", "type": "function", "function": {"name", "arguments"}}]
        print(json.dumps({"tool_calls": [c.model_dump() for c in out.tool_calls]}, ensure_ascii=False))
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)


CUT_SHORT = "the output is cut short: it reached max_tokens before its constraint was complete"


def _say_if_no_worker(job) -> None:
    """A queue accepts work while no worker runs; say so rather than wait in silence."""
    status = job.status() or ""
    if status.startswith("queued, no live worker"):
        print(f"mlxq submit: job {job.id} {status}; waiting for one (Ctrl-C leaves the job queued)",
              file=sys.stderr, flush=True)


def add_commands(sub) -> None:
    p = sub.add_parser("submit", help="submit a prompt and stream the answer",
                       description="Submit a prompt and stream the answer to stdout. With --tools, the calls the "
                                   "model made follow as one JSON line: {\"tool_calls\": [...]}.")
    add_shared(p, "redis_url", "queue", "model", "api_key",
               help={"model": "a model directory or GGUF file: the queue its worker serves (--model NAME, "
                              "a queue name, is the deprecated spelling of --queue NAME) (default: none)"})
    p.add_argument("text", help="the prompt")
    p.add_argument("--max-tokens", type=int,
                   help=f"most tokens to generate (default: {DEFAULT_MAX_TOKENS}, as Client's; cut to what the "
                        "model's context leaves)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens of this mass")
    p.add_argument("--seed", type=int, help="sampling seed, for reproducible sampled output (default: none)")
    p.add_argument("--stop", action="append", help="a stop string; repeat for several (default: none)")
    p.add_argument("--chat", action="store_true",
                   help="send as a user message (applies the chat template; implied by --tools)")
    p.add_argument("--defer-s", type=float, metavar="SECONDS",
                   help="queue the job this many seconds from now (it waits in Redis) (default: now)")
    p.add_argument("--expires-in", type=float, metavar="SECONDS",
                   help="end the job 'expired', never run, if no worker has started it within this many seconds "
                        "(default: never)")
    p.add_argument("--webhook", metavar="URL", help="POST a signed summary here when the job ends (a host the "
                   "operator allowed: MLXQ_WEBHOOK_HOSTS; docs/pipelines/job-life.md) (default: none)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the job's stats")
    add_output_options(p)
    p.set_defaults(func=cmd_submit)
