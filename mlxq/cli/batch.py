"""``mlxq batch IN.jsonl -o OUT.jsonl``: every line submitted at the low tier, resumable
(the run itself: :mod:`mlxq.producer.bulk`)."""

from __future__ import annotations

import argparse
import json

from ..shared.schemas import DEFAULT_MAX_TOKENS
from .options import add_shared, queue_of
from .output import add_output_options, output_params


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def cmd_batch(args) -> int:
    from ..producer.bulk import BatchRun
    from ..producer.client import Client

    defaults = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature)) if v is not None}
    defaults.update(output_params(args))  # files read (and refused) before connecting
    with open(args.input, "rb"):  # the input too: a missing file is one line at once, not after Redis
        pass
    client = Client(args.redis_url, api_key=args.api_key, model=queue_of(args))
    summary = BatchRun(client, args.input, args.output, window=args.window, progress=not args.quiet,
                       webhook=args.webhook, **defaults).run()
    print(json.dumps(summary.__dict__))
    return 130 if summary.interrupted else 0


def add_commands(sub) -> None:
    p = sub.add_parser("batch", help="submit every line of a JSONL file at the low tier; resumable")
    add_shared(p, "redis_url", "queue", "model", "api_key",
               help={"model": "a model directory or GGUF file: the queue its worker serves (--model NAME, "
                              "a queue name, is the deprecated spelling of --queue NAME) (default: none)"})
    p.add_argument("input", help="JSONL: a prompt string or an object of submit arguments per line")
    p.add_argument("-o", "--output", required=True, help="JSONL results (appended; finished lines are skipped)")
    p.add_argument("--max-tokens", type=int,
                   help=f"max_tokens of lines that do not set it (default: {DEFAULT_MAX_TOKENS}, as Client's; "
                        "16 for a /v1/completions line, as OpenAI's)")
    p.add_argument("--temperature", type=float,
                   help="temperature of lines that do not set it (default: the request's default, 0: greedy)")
    add_output_options(p, "Defaults for every line (these and the penalties): a line's own response_format, tools, "
                          "tool_choice, presence_penalty, frequency_penalty or logit_bias wins.")
    p.add_argument("--window", type=_at_least_one, default=256, help="most jobs in flight (default 256)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--webhook", metavar="URL",
                   help="POST a signed bulk.completed summary here once every line is in the output (a host on "
                        "the operator's webhook_hosts; delivered by `mlxq webhooks run`; default: none)")
    p.set_defaults(func=cmd_batch)
