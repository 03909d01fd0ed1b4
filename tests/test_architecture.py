"""The layers of the code (issue 18), checked by import-linter with the contract in pyproject.toml:
the face ``mlxq/`` (public API, CLI, demo, dev kit) above ``mlxq.producer | mlxq.worker``
(siblings that never import each other) above ``mlxq.shared``; and no import cycles among
the modules of any package.

import-linter reads a package from one folder, as it is installed; a checkout (or an editable
install) keeps ``producer/``, ``worker/`` and ``shared/`` beside ``mlxq/``. The test lays the
sources out as the wheel does, in a temporary folder, and lints that."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
# pyproject.toml's [tool.setuptools.package-dir]: where each installed package's sources live
PACKAGE_DIRS = {"mlxq": "mlxq", "mlxq/producer": "producer", "mlxq/worker": "worker", "mlxq/shared": "shared"}


def installed_layout(dest: Path) -> Path:
    """The Python sources under ``dest`` as they are installed (``dest/mlxq/producer/...``)."""
    for target, source in PACKAGE_DIRS.items():
        shutil.copytree(ROOT / source, dest / target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "build", "csrc", "lua"))
    return dest


def lint(tree: Path) -> subprocess.CompletedProcess:
    # the copied tree first on the path, so it (not the checkout's `mlxq`) is the package linted
    env = {"PATH": str(LINT_IMPORTS.parent), "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_imports_keep_the_layers(tmp_path):
    out = lint(installed_layout(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout, out.stdout


def test_an_import_across_the_layers_breaks_the_build(tmp_path):
    tree = installed_layout(tmp_path)
    stats = tree / "mlxq" / "producer" / "stats.py"  # a producer module that reaches into the worker
    stats.write_text(stats.read_text() + "\nfrom ..worker import progress  # noqa: E402,F401\n")
    out = lint(tree)
    assert out.returncode != 0, out.stdout
    assert "1 kept, 1 broken" in out.stdout and "mlxq.producer.stats -> mlxq.worker.progress" in out.stdout, \
        out.stdout


def test_an_import_cycle_breaks_the_build(tmp_path):
    tree = installed_layout(tmp_path)
    keys = tree / "mlxq" / "shared" / "keys.py"  # shared.keys <-> shared.settings
    keys.write_text(keys.read_text() + "\nfrom . import settings  # noqa: E402,F401\n")
    settings = tree / "mlxq" / "shared" / "settings.py"
    settings.write_text(settings.read_text() + "\nfrom . import keys  # noqa: E402,F401\n")
    out = lint(tree)
    assert out.returncode != 0, out.stdout
    assert "1 kept, 1 broken" in out.stdout and "No cycles are allowed in mlxq.shared" in out.stdout, out.stdout
