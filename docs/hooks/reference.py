"""MkDocs hook: the settings and CLI reference pages are generated at build time from the code itself
(``Settings``'s fields and the ``mlxq`` argparse parser), so they cannot go stale.  A page asks for a table
with a marker line, ``<!-- reference:settings -->`` or ``<!-- reference:cli -->``.

Nothing here imports MLX: the settings module imports only the standard library, and the CLI parser
imports its commands lazily.  A reference that cannot be built is a warning, which fails ``mkdocs build
--strict`` (tests/project/test_docs.py) rather than publishing an empty page."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import MISSING, fields
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.reference")
ROOT = Path(__file__).resolve().parents[2]
MARKERS = {"<!-- reference:settings -->": "settings_reference", "<!-- reference:cli -->": "cli_reference"}


def _installed_first() -> None:
    """mkdocs runs in the checkout, whose root (on ``sys.path``) holds a folder named ``mlxq`` that is
    not the installed package (producer/, worker/ and shared/ are mapped into it at install): the
    reference is of what is installed, so that folder must not shadow it."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != str(ROOT)]


def on_page_markdown(markdown: str, page, config, files) -> str:
    _installed_first()
    for marker, builder in MARKERS.items():
        if marker in markdown:
            try:
                text = globals()[builder]()
            except Exception as exc:  # noqa: BLE001 -- any failure is reported, and fails a strict build
                log.warning("%s: the %s could not be generated: %s: %s", page.file.src_path,
                            builder.replace("_", " "), type(exc).__name__, exc)
                text = f"*(not generated: {type(exc).__name__}: {exc})*"
            markdown = markdown.replace(marker, text)
    return markdown


# -- settings ----------------------------------------------------------------------------------------
def _settings_module():
    try:
        return importlib.import_module("mlxq.shared.settings")
    except ImportError:  # a checkout without an install: the module needs only the standard library
        spec = importlib.util.spec_from_file_location("_mlxq_settings", ROOT / "shared" / "settings.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (dataclasses look their module up while the class is made)
        spec.loader.exec_module(module)
        return module


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def settings_reference() -> str:
    mod = _settings_module()
    rows = ["| setting | environment variable | `mlxq worker` flag | default | what it does |",
            "|---|---|---|---|---|"]
    for f in fields(mod.Settings):
        meta = f.metadata
        default = f.default if f.default_factory is MISSING else f.default_factory()
        if meta.get("secret"):
            shown = "none"
        else:
            shown = meta.get("shown_default") or (meta["show"](default) if meta.get("show") else default)
            if isinstance(shown, bool):
                shown = "on" if shown else "off"
        flag = mod.flag(f.name)
        rows.append(f"| `{f.name}` | `{mod.env_var(f.name)}` | {f'`{flag}`' if flag else '—'} | "
                    f"`{_cell(shown)}` | {_cell(meta.get('help', ''))} |")
    return "\n".join(rows)


# -- the command line ----------------------------------------------------------------------------------
PARSER_NAMES = ("build_parser", "make_parser", "parser")


def _find_parser() -> argparse.ArgumentParser:
    """The ``mlxq`` parser from whatever builds it: ``mlxq.cli.build_parser`` (a module or a package),
    else a ``build_parser`` in one of the package's modules."""
    cli = importlib.import_module("mlxq.cli")
    candidates = [cli]
    if hasattr(cli, "__path__"):  # a package: look in its modules too
        import pkgutil

        candidates += [importlib.import_module(f"mlxq.cli.{m.name}") for m in pkgutil.iter_modules(cli.__path__)]
    for module in candidates:
        for name in PARSER_NAMES:
            build = getattr(module, name, None)
            if isinstance(build, argparse.ArgumentParser):
                return build
            if callable(build):
                try:
                    parser = build()
                except TypeError:  # a function of that name that wants arguments: not the builder
                    continue
                if isinstance(parser, argparse.ArgumentParser):
                    return parser
    raise LookupError(f"no function {' / '.join(PARSER_NAMES)} returning an ArgumentParser in mlxq.cli")


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if sub is not parser:
                    yield from _commands(sub, (*path, name))


def cli_reference() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: fixed, so the page is the same everywhere
    os.environ["NO_COLOR"] = "1"
    parser = _find_parser()
    out, seen = [], set()
    for path, sub in _commands(parser, ("mlxq",)):
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        title = " ".join(path)
        level = "##" if len(path) <= 2 else "###"
        out += [f"{level} `{title}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out)
