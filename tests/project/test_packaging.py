"""mlxq installs one top-level import name, and it coexists with an application's own
``shared``/``worker``/``producer`` packages."""

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path
from workerkit import neutral_cwd

from repokit import ROOT


def test_user_packages_named_like_ours_do_not_clash(tmp_path):
    for name in ("shared", "worker", "producer"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"WHOSE = 'the application\\'s {name}'\n")
    script = textwrap.dedent("""
        from mlxq import Client, AsyncClient, AuthError, OverloadError
        import mlxq.shared.keys, mlxq.worker.engine.block_manager
        import shared, worker, producer
        assert shared.WHOSE == "the application's shared", shared.__file__
        assert worker.WHOSE == "the application's worker", worker.__file__
        assert producer.WHOSE == "the application's producer", producer.__file__
        import mlxq
        print("ok", Client.__module__, mlxq.generate.__module__)
    """)
    # cwd first on sys.path (as for any application); mlxq from the install
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "mlxq.producer.client", "mlxq.producer.rq_bridge"]


def test_installed_distribution_has_one_top_level_name():
    # the wheel's RECORD (an egg-info left in the checkout by a build lists sources, not the install)
    records = [d.read_text("RECORD") for d in importlib.metadata.distributions(name="mlxq")]
    records = [r for r in records if r]
    if not records:
        import pytest
        pytest.skip("mlxq is not installed from a wheel (tests run from the checkout)")
    for record in records:
        paths = [line.split(",")[0] for line in record.splitlines() if line]
        tops = {p.split("/")[0] for p in paths if p.endswith(".py") and not p.startswith("..")}
        tops = {t for t in tops if not t.startswith("__editable__")}  # an editable install's finder
        assert tops <= {"mlxq"}, tops


def test_python_dash_m_mlxq_is_the_cli():
    out = subprocess.run([sys.executable, "-m", "mlxq", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=neutral_cwd())
    assert out.returncode == 0, out.stderr
    assert "worker" in out.stdout and "submit" in out.stdout


def test_the_tests_see_only_the_installed_package():
    """No bare ``producer``/``worker``/``shared`` and no ``mlxq.tests``: the checkout's folders are
    reached only as the installed ``mlxq.producer``, ``mlxq.worker`` and ``mlxq.shared``."""
    import importlib.util

    import mlxq

    for name in ("producer", "worker", "shared", "tests", "mlxq.tests", "mlxq.mlxq"):
        assert importlib.util.find_spec(name) is None, name
    assert len(mlxq.__path__) == 1, mlxq.__path__


def test_importing_from_the_checkouts_root_says_what_to_do():
    """With mlxq installed from a wheel, the checkout's root first on sys.path shadows it."""
    import mlxq

    if Path(mlxq.__file__).resolve().parent == ROOT / "mlxq":
        import pytest
        pytest.skip("an editable install: its finder maps producer/, worker/, shared/ into the checkout's mlxq too")
    out = subprocess.run([sys.executable, "-c", "import mlxq"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 1
    assert "lacks producer/, worker/ and shared/" in out.stderr and ".venv/bin/pytest" in out.stderr, out.stderr
