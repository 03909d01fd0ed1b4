"""Build and load the paged-attention CPU extension (the C++ sources in ``csrc/``).

Build strategy: compile on first use, into a cache directory, never into the package.

* Where: ``$MLXQ_CACHE_DIR/ext/<key>/`` (default ``~/.cache/mlxq/ext``), where the key
  names the mlx version, the nanobind version, the Python ABI, the machine and a hash
  of the sources. A wheel install, an editable install and a source checkout (where
  ``mlxq`` resolves to the checkout, not to site-packages) all find the same build,
  and an upgrade of mlx or of the sources builds afresh.
* Once: a file lock (``<key>.lock``) makes concurrent workers and test processes
  build once; the others wait and load the result. The library is moved into place
  with an atomic rename, so nobody loads a half-written file.
* How: CMake (``cmake>=3.27`` and ``nanobind`` are package dependencies from PyPI;
  the ``cmake`` package's own binary is used, not whichever is first on PATH) with
  the mlx wheel's CMake config. About 20-40 s on 2 cores. ``mlxq build-ext`` runs it
  ahead of time (the Dockerfile does).
* When it can't: installation has already succeeded (nothing is compiled at install
  time); ``load()`` raises :class:`ExtensionUnavailable` with the reason and the tail
  of the build log, the worker logs it and uses the gather path. A failed build is
  remembered (``<key>.failed``) so every worker start does not retry it;
  ``mlxq build-ext`` retries.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

from ....shared.settings import cache_dir

from ... import progress

log = logging.getLogger(__name__)

MODULE = "_mlxq_paged_attention"
SOURCE_DIR = Path(__file__).resolve().with_name("csrc")
MIN_CMAKE = (3, 27)
BUILD_TIMEOUT_S = 900


class ExtensionUnavailable(RuntimeError):
    """The CPU extension could not be built or loaded; the message says why."""


def cache_root() -> Path:
    return cache_dir() / "ext"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def source_hash() -> str:
    h = hashlib.sha256()
    for f in sorted(SOURCE_DIR.iterdir()):
        if f.is_file() and f.suffix in (".cpp", ".h", ".txt"):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def build_key() -> str:
    abi = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag
    parts = [
        "paged_attention",
        "mlx" + _version("mlx"),
        "nb" + _version("nanobind"),
        abi,
        platform.machine(),
        source_hash(),
    ]
    return "-".join(p.replace("/", "_") for p in parts)


def ext_dir() -> Path:
    return cache_root() / build_key()


def built_library() -> Path | None:
    d = ext_dir()
    if not d.is_dir():
        return None
    found = sorted(d.glob(MODULE + "*.so")) + sorted(d.glob(MODULE + "*.pyd"))
    return found[0] if found else None


@contextlib.contextmanager
def _locked(key_dir: Path):
    key_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(key_dir.parent / (key_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def find_cmake() -> str:
    """The PyPI ``cmake`` package's binary if installed (>= 3.27), else one on PATH."""
    candidates = []
    try:
        import cmake  # the PyPI package: a module that knows its own binary

        candidates.append(str(Path(cmake.CMAKE_BIN_DIR) / "cmake"))
    except Exception:  # noqa: BLE001 - not installed, or a different module of that name
        pass
    on_path = shutil.which("cmake")
    if on_path:
        candidates.append(on_path)
    seen = []
    for exe in candidates:
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
            ver = tuple(int(x) for x in out.split()[2].split(".")[:2])
        except (OSError, subprocess.SubprocessError, IndexError, ValueError):
            continue
        if ver >= MIN_CMAKE:
            return exe
        seen.append(f"{exe} ({'.'.join(map(str, ver))})")
    raise ExtensionUnavailable(
        f"no cmake >= {'.'.join(map(str, MIN_CMAKE))} (found: {', '.join(seen) or 'none'}; "
        "`pip install cmake` provides one)")


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def build(force: bool = False) -> Path:
    """Build the extension unless a build for this key exists; return the library's path.

    Raises :class:`ExtensionUnavailable` (and records it) when the build fails.
    """
    d = ext_dir()
    failed = d.parent / (d.name + ".failed")
    with _locked(d):
        lib = built_library()
        if lib is not None and not force:
            return lib
        if failed.exists() and not force:
            raise ExtensionUnavailable(
                f"an earlier build failed ({failed.read_text().strip()}); "
                "run `mlxq build-ext` to try again")
        try:
            lib = _build_locked(d)
        except ExtensionUnavailable as e:
            failed.write_text(str(e).splitlines()[0] + "\n")
            raise
        failed.unlink(missing_ok=True)
        return lib


def _build_locked(d: Path) -> Path:
    try:
        import nanobind  # noqa: F401
    except ImportError as e:
        raise ExtensionUnavailable("nanobind is not installed (`pip install nanobind`)") from e
    cmake = find_cmake()
    d.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=d))
    logfile = d / "build.log"
    env = dict(os.environ)
    # the interpreter's own bin first: `python -m nanobind` / `-m mlx` inside CMake
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    jobs = str(max(1, min(4, os.cpu_count() or 1)))
    steps = [
        [cmake, "-S", str(SOURCE_DIR), "-B", str(work), "-DCMAKE_BUILD_TYPE=Release",
         f"-DPython_EXECUTABLE={sys.executable}"],
        [cmake, "--build", str(work), "--parallel", jobs],
    ]
    try:
        with open(logfile, "w") as out, progress.step(
                log, "compiling the paged-attention CPU extension", total=100, unit="%",
                expect=f"once per mlx version and source, ~15-40 s; log: {logfile}") as bar:
            for cmd in steps:
                out.write("$ " + " ".join(cmd) + "\n")
                out.flush()
                rc = _run_step(cmd, out, env, bar)
                if rc != 0:
                    raise ExtensionUnavailable(
                        f"build failed ({Path(cmd[0]).name} exit {rc}; log: {logfile}):\n"
                        + _tail(logfile))
        products = sorted(work.glob(MODULE + "*.so")) + sorted(work.glob(MODULE + "*.pyd"))
        if not products:
            raise ExtensionUnavailable(f"the build produced no {MODULE} library (log: {logfile})")
        target = d / products[0].name
        tmp = d / (products[0].name + ".tmp")
        shutil.copy2(products[0], tmp)
        os.replace(tmp, target)  # atomic: loaders never see half a file
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("built %s", target)
    return target


_PERCENT = re.compile(rb"^\[\s*(\d+)%\]")


def _run_step(cmd: list[str], out, env: dict, bar) -> int:
    """Run one build command, its output into the log file; CMake's ``[ NN%]`` lines move the bar."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    except OSError as e:
        raise ExtensionUnavailable(f"build step failed: {e}") from e
    killed = threading.Event()
    timer = threading.Timer(BUILD_TIMEOUT_S, lambda: (killed.set(), proc.kill()))
    timer.start()
    try:
        for line in proc.stdout:
            out.write(line.decode(errors="replace"))
            m = _PERCENT.match(line)
            if m and int(m.group(1)) > bar.n:
                bar.update(int(m.group(1)) - bar.n)
        rc = proc.wait()
    finally:
        timer.cancel()
    if killed.is_set():
        raise ExtensionUnavailable(f"build step failed: {Path(cmd[0]).name} killed after {BUILD_TIMEOUT_S} s")
    return rc


def import_library(path: Path):
    """Import the built module (mlx.core first: the extension uses its nanobind types)."""
    import mlx.core  # noqa: F401

    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        raise ExtensionUnavailable(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise ExtensionUnavailable(f"cannot import {path}: {e}") from e
    return module


def load(build_if_missing: bool = True):
    """The extension module, built first if needed. Raises :class:`ExtensionUnavailable`."""
    if not SOURCE_DIR.is_dir():
        raise ExtensionUnavailable(f"the C++ sources are not installed ({SOURCE_DIR} is missing)")
    lib = built_library()
    if lib is None:
        if not build_if_missing:
            raise ExtensionUnavailable("the extension is not built (run `mlxq build-ext`)")
        lib = build()
    return import_library(lib)

