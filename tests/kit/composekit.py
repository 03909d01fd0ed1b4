"""docker-compose.yml as the deployment tests read it: the file, and each ``mlxq`` command of a service
parsed by the CLI's own parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml
from repokit import ROOT

from mlxq.cli import build_parser


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def mlxq_invocations(command) -> list[list[str]]:
    """Each ``mlxq ...`` argv in a service command (a list, or ``sh -c "a && exec b"``)."""
    if command[:2] in (["sh", "-c"], ["/bin/sh", "-c"]):
        out = []
        for part in re.split(r"&&|;", command[2]):
            argv = shlex.split(part)
            argv = argv[1:] if argv and argv[0] == "exec" else argv
            out.append(argv)
        return [a for a in out if a and Path(a[0]).name == "mlxq"]
    return [command] if Path(command[0]).name == "mlxq" else []


def parse_mlxq(argv: list[str]):
    return build_parser().parse_args(argv[1:])
