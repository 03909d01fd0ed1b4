"""Options every ``mlxq`` command shares, accepted before or after the sub-command.

``mlxq --redis-url URL keys add KEY --tier low`` and ``mlxq keys add KEY --tier low --redis-url URL``
mean the same.  Each parser (the top one and every sub-command, nested ones included) declares the
shared options with ``default=SUPPRESS``, so a sub-command's default never overwrites a value given
before it; ``finish()`` fills the defaults once parsing is done, and refuses an option given to a
command that has no use for it.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from ..shared.logs import LOG_FORMATS
from ..shared.settings import Settings


@dataclass(frozen=True)
class SharedOption:
    flag: str
    help: str
    default: Callable[[], Optional[str]]
    choices: Optional[tuple] = None


# The defaults of --redis-url, --log-level, --log-format and --api-key are their Settings fields, each read
# alone (Settings.read): at parse time logging is not set up yet, and the command's own settings report
# unknown MLXQ_ variables once.
SHARED = {
    "redis_url": SharedOption("--redis-url", "Redis URL: redis://, rediss:// (TLS), unix://; "
                              "default: $MLXQ_REDIS_URL", lambda: Settings.read("redis_url")),
    "log_level": SharedOption("--log-level", "DEBUG, INFO, WARNING or ERROR (default: $MLXQ_LOG_LEVEL or INFO)",
                              lambda: Settings.read("log_level")),
    # every process logs alike: worker, gateway, the CLI's commands
    "log_format": SharedOption("--log-format", "text, or one JSON object per line with job and attempt fields "
                               "(default: $MLXQ_LOG_FORMAT or text)",
                               lambda: Settings.read("log_format"), LOG_FORMATS),
    "model": SharedOption("--model", "the model: a model directory, GGUF file or hub id (default: none)",
                          lambda: None),
    "queue": SharedOption("--queue", "the queue to send to: a served model's name (default: $MLXQ_MODEL, "
                          "or the only model served)", lambda: None),
    "api_key": SharedOption("--api-key", "an mlxq API key; it sets the tier; prefer $MLXQ_API_KEY: a command "
                            "line lands in shell history and `ps` (default: $MLXQ_API_KEY)",
                            lambda: Settings.read("api_key")),
}
ALWAYS = ("log_level", "log_format")


def add_shared(p: argparse.ArgumentParser, *names: str, required: tuple[str, ...] = (),
               help: Optional[dict[str, str]] = None) -> None:
    """Declare shared options on a (sub-)command: ``--log-level`` and ``--log-format`` always, plus ``names``."""
    for name in ALWAYS + tuple(n for n in names if n not in ALWAYS):
        opt = SHARED[name]
        text = (help or {}).get(name, opt.help) + (" (required)" if name in required else "")
        p.add_argument(opt.flag, dest=name, default=argparse.SUPPRESS, help=text, choices=opt.choices)
    p.set_defaults(_shared=tuple(names), _required=tuple(required))


def finish(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Defaults for the shared options a command uses; an error for one it does not."""
    uses = set(getattr(args, "_shared", ())) | set(ALWAYS)
    command = " ".join(x for x in (getattr(args, "command", None), getattr(args, "action", None)) if x)
    for name, opt in SHARED.items():
        if hasattr(args, name):
            if name not in uses:
                parser.error(f"{opt.flag} does not apply to `mlxq {command}`")
            if name == "api_key":  # still taken (scripts pass it), with a warning: it registers nothing
                print("mlxq: --api-key puts the key in shell history and `ps`; set MLXQ_API_KEY instead",
                      file=sys.stderr)
        else:
            setattr(args, name, opt.default() if name in uses else None)
    for name in getattr(args, "_required", ()):
        if not getattr(args, name):
            parser.error(f"`mlxq {command}` needs {SHARED[name].flag}")
    return args


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already names it: "(default: X)";
    an on/off flag reads "(default: off)".  An option whose default is None says in its own help text
    what happens without it (a test checks that every option's help mentions its default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return f"{text} (default: {'on' if action.default else 'off'})"
        if action.default is None:
            return text
        return f"{text} (default: %(default)s)"


class SubParser(argparse.ArgumentParser):
    """A sub-command's parser: defaults in its help; it does not finish on its own."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*a, **kw)


class Parser(argparse.ArgumentParser):
    """The top-level parser: shared options anywhere, finished once after the whole line is parsed."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*a, **kw)
        add_shared(self, *SHARED)
        self.set_defaults(_shared=(), _required=())

    def add_subparsers(self, **kw):
        kw.setdefault("parser_class", SubParser)  # sub-commands do not finish on their own
        return super().add_subparsers(**kw)

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        return finish(self, ns), extras


# -- flags generated from Settings (mlxq worker, mlxq gateway) ----------------------------------------------
def add_setting_flags(p, flags) -> None:
    """One option per :class:`mlxq.shared.settings.Flag` on a parser or argument group; None when not given
    (the environment, then the field's default, decide)."""
    for f in flags:
        if f.is_bool:  # --keep-dtype / --no-keep-dtype
            p.add_argument(f.flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=f.help)
        else:
            p.add_argument(f.flag, dest=f.name, type=_argtype(f), default=None, choices=f.choices, help=f.help)


def _argtype(f):
    """The setting's own parser, named for argparse's message ("invalid integer value: 'x'")."""
    def parse(text: str):
        try:
            return f.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = f.name
    return parse


def settings_from(args: argparse.Namespace, flags) -> Settings:
    """``MLXQ_*`` from the environment, each of these flags given on the command line over it."""
    given = {f.name: getattr(args, f.name, None) for f in flags}
    return Settings.from_env(redis_url=args.redis_url, log_format=getattr(args, "log_format", None), **given)


# -- old spellings -------------------------------------------------------------------------------------------
def deprecation(old: str, new: str, why: str = "") -> None:
    """One line on stderr: the old spelling still works, this once more."""
    print(f"mlxq: {old} is deprecated{why}; use {new}", file=sys.stderr)


def deprecated_alias(p: argparse.ArgumentParser, old: str, dest: str, type=None) -> None:
    """``old`` still sets ``dest``, with a deprecation line; it is left out of ``--help``."""
    new = "--" + dest.replace("_", "-")

    class Alias(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            deprecation(old, new)
            setattr(namespace, dest, values)

    p.add_argument(old, dest=dest, action=Alias, type=type, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def queue_of(args: argparse.Namespace) -> Optional[str]:
    """The queue a producer command targets: ``--queue``; a ``--model`` that names a model directory or file
    targets the queue a worker serves it under (its name); ``--model NAME`` that is no path is the old
    spelling of ``--queue NAME``, still taken with a deprecation line."""
    if getattr(args, "queue", None):
        return args.queue
    model = getattr(args, "model", None)
    if not model:
        return None
    from ..shared.keys import model_name

    if os.path.exists(model) or model.lower().endswith(".gguf") or "/" in model:
        return model_name(model)  # a directory, a file or a hub id: the name its worker serves it under
    deprecation(f"--model {model}", f"--queue {model}", " for a queue name (--model names a model directory or file)")
    return model
