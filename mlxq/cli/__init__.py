"""``mlxq``: the command line, one module per command group (after rq's ``cli/``).

    worker                       mlxq.cli.worker     run an MLX worker for one model
    submit                       mlxq.cli.submit     one prompt, its answer streamed
    batch                        mlxq.cli.batch      a JSONL file at the low tier, resumable
    gateway                      mlxq.cli.gateway    the OpenAI-compatible HTTP gateway
    dashboard                    mlxq.cli.dashboard  the operator's pages (also under the gateway)
    jobs                         mlxq.cli.jobs       list, show, cancel, tail, requeue; the dead-letter set
    stats                        mlxq.cli.stats      queues and workers, once or --watch
    keys, tiers, acl-producer    mlxq.cli.keys       API keys, tier policy, the producer ACL recipe
    webhooks                     mlxq.cli.webhooks   deliver completion webhooks; list deliveries
    demo, redis, make-model, build-ext   mlxq.cli.local   things that run on this machine

Options every command shares (``--redis-url``, ``--log-level``, ...) are in :mod:`mlxq.cli.options`.
Nothing below this package (producer, worker, shared) imports argparse.
"""

from __future__ import annotations

import argparse
import sys

from . import batch, dashboard, gateway, jobs, keys, local, stats, submit, webhooks, worker
from .options import Parser
from ..shared.extras import MissingExtra
from ..shared.genopts import error_text
from ..shared.logs import setup_logging

# the order `mlxq --help` lists them in
GROUPS = (worker, submit, batch, gateway, dashboard, jobs, stats, keys, webhooks, local)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlxq")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mlxq", description="Redis-queue-driven LLM inference on MLX",
                    epilog="--redis-url, --log-level, --model, --queue and --api-key may come before or after "
                           "the command, in every command that uses them.")
    parser.add_argument("--version", action="version", version=f"mlxq {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for group in GROUPS:
        group.add_commands(sub)
    return parser


def _user_errors() -> tuple:
    import redis

    from ..producer.errors import JobTimeout, NoModelError
    from ..shared.apikeys import AuthError
    from ..shared.protocol import JobRefused, OverloadError, QuotaExceeded

    # OSError: an input file that is missing or unreadable (mlxq batch IN.jsonl)
    return (AuthError, OverloadError, QuotaExceeded, JobRefused, NoModelError, JobTimeout, ValueError, redis.ConnectionError,
            OSError)


def main(argv: list[str] | None = None) -> int:
    user_errors = _user_errors()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `mlxq`: what it can do
        parser.print_help()
        return 0
    setup_logging(args.log_level, args.log_format)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except MissingExtra as exc:  # e.g. `mlxq worker` in a producer-only install
        print(f"mlxq {args.command}: {exc}", file=sys.stderr)
        return 1
    except user_errors as exc:  # a clear message, not a traceback
        print(f"mlxq {args.command}: {type(exc).__name__}: {error_text(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
