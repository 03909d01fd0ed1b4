"""The layers of the code, checked by import-linter with the contract in pyproject.toml:
the face ``mlxq/`` (public API, CLI, demo, dev kit) above ``mlxq.producer | mlxq.worker``
(siblings that never import each other) above ``mlxq.shared``; and no import cycles among
the modules of any package.  import-linter sees only ``import`` statements, so the test also refuses
``importlib.import_module`` and ``__import__`` of mlxq's own modules: an import through them would hide
a layer crossing or a cycle from the contract.

import-linter reads a package from one folder, as it is installed; a checkout (or an editable
install) keeps ``producer/``, ``worker/`` and ``shared/`` beside ``mlxq/``. The test lays the
sources out as the wheel does, in a temporary folder, and lints that."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

from repokit import ROOT
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
# pyproject.toml's [tool.setuptools.package-dir]: where each installed package's sources live
PACKAGE_DIRS = {"mlxq": "mlxq", "mlxq/producer": "producer", "mlxq/worker": "worker", "mlxq/shared": "shared"}


def installed_layout(dest: Path) -> Path:
    """The Python sources under ``dest`` as they are installed (``dest/mlxq/producer/...``)."""
    for target, source in PACKAGE_DIRS.items():
        shutil.copytree(ROOT / source, dest / target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "build", "csrc", "lua"))
    return dest


def dynamic_imports(tree: Path) -> list[str]:
    """``path:line`` of each ``importlib.import_module(...)`` or ``__import__(...)`` under ``tree`` (as
    installed) that may load one of mlxq's modules: a relative name, one under ``mlxq``, or a name not
    written in the call (it may be either)."""
    found = []
    for path in sorted((tree / "mlxq").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name not in ("import_module", "__import__"):
                continue
            arg = node.args[0] if node.args else None
            third_party = (isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                           and not arg.value.startswith(".") and arg.value.split(".")[0] != "mlxq"
                           and not any(k.arg == "package" for k in node.keywords))
            if not third_party:
                found.append(f"{path.relative_to(tree)}:{node.lineno}")
    return found


def lint(tree: Path) -> subprocess.CompletedProcess:
    # the copied tree first on the path, so it (not the checkout's `mlxq`) is the package linted
    env = {"PATH": str(LINT_IMPORTS.parent), "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_imports_keep_the_layers(tmp_path):
    out = lint(installed_layout(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout, out.stdout


def test_no_module_of_ours_is_imported_through_importlib(tmp_path):
    assert dynamic_imports(installed_layout(tmp_path)) == []


def test_an_importlib_import_of_ours_breaks_the_build(tmp_path):
    tree = installed_layout(tmp_path)
    constraints = tree / "mlxq" / "shared" / "constraints.py"
    constraints.write_text(constraints.read_text() + "\nimport importlib  # noqa: E402\n"
                           "tools = importlib.import_module('.tools', __package__)\n"
                           "grammars = __import__('mlxq.shared.grammars')\n"
                           "yaml = importlib.import_module('yaml')\n")
    lines = len(constraints.read_text().splitlines())
    assert dynamic_imports(tree) == [f"mlxq/shared/constraints.py:{lines - 2}",
                                     f"mlxq/shared/constraints.py:{lines - 1}"]


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
