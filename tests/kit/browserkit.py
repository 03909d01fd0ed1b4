"""A real browser for the dashboard's tests: Debian's chromium driven by Playwright's Python API (its
``executable_path``; Playwright downloads no browser). ``chromium()`` installs the Debian package when
it is missing and this process may (root, apt-get), as the tests start their own Valkey; otherwise the
tests that need it skip, saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

CHROMIUM = "/usr/bin/chromium"
# the closed network refuses Chromium's own background connections: none are made
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
INSTALL_TIMEOUT_S = 240  # all of the install, within the first browser test's own timeout (pytest-timeout)
_tried: list[str] = []  # the reason it is missing, once found (the install is tried once a session)


def chromium() -> tuple[str | None, str]:
    """(chromium's path, "") or (None, why the browser tests skip)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return None, "playwright is not installed (pip install '.[test]')"
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM, ""
    if _tried:
        return None, _tried[0]
    _tried.append(_install())
    return (CHROMIUM, "") if os.access(CHROMIUM, os.X_OK) else (None, _tried[0])


def _install() -> str:
    """Install Debian's chromium, quietly; the reason it is still missing ("" when installed)."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"{CHROMIUM} is missing, and installing Debian's chromium needs root and apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]
    started = time.monotonic()
    left = lambda: max(1.0, INSTALL_TIMEOUT_S - (time.monotonic() - started))  # noqa: E731
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left())
        if done.returncode != 0:  # a stale package list: update it once, then try again
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=left())
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left())
    except subprocess.TimeoutExpired:
        return f"installing Debian's chromium took over {INSTALL_TIMEOUT_S}s"
    if done.returncode != 0:
        return f"apt-get install chromium failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
    print(f"browserkit: installed Debian's chromium in {time.monotonic() - started:.0f}s")
    return ""
