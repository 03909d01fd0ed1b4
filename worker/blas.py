"""Put an optimized BLAS under MLX's CPU backend on Linux.

The Linux ``mlx[cpu]`` wheel links the reference BLAS (about 5 GFLOP/s for an
fp32 matmul on these machines).  ``libmlx.so`` resolves ``cblas_sgemm`` at load
time through the process's global symbol scope, so a BLAS loaded with
``RTLD_GLOBAL`` *before* ``import mlx.core`` takes its place, exactly as
``LD_PRELOAD`` would.  This module does that, once, and reports what it did.

Candidates, first hit wins:

1. ``MLXQ_BLAS_LIB``: an explicit path to a ``libopenblas.so``;
2. the system OpenBLAS (Debian ``libopenblas0-pthread``);
3. the ``cmeel-openblas`` wheel (a dependency of mlxq on Linux x86_64).  It
   needs ``libgfortran.so.5``; when the system has none, the copy the mlx wheel
   ships is used (a soname-patched copy of it is kept in the cache directory).

``MLXQ_BLAS=off`` skips all of this; ``MLXQ_BLAS_THREADS=N`` sets OpenBLAS's thread
count (default: all cores, measured in :func:`default_threads`; ``default``: OpenBLAS's own choice).  Nothing
here imports MLX.

These three variables are read here, from the environment, and are not :class:`~mlxq.shared.settings.Settings`
fields, by design: the BLAS must be loaded before MLX is first imported, which can be before any settings are
built (a test, a bench, the dev kit), and the choice is the process's, not a queue setting's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import platform
import shutil
import struct
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from ..shared.settings import cache_dir

_SYSTEM_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


@dataclass
class BlasStatus:
    active: bool
    message: str
    library: str | None = None
    config: str | None = None
    steps: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return self.message


_status: BlasStatus | None = None
_keep: list[ctypes.CDLL] = []  # loaded libraries must outlive this module's frames


def status() -> BlasStatus | None:
    """What :func:`setup` did, or None when it has not run."""
    return _status


def describe() -> str:
    """What :func:`setup` did, for the worker's logs and stats (also when it was never called)."""
    if _status is None:
        return "not set up (mlxq.worker.blas.setup() was not called before MLX): MLX's bundled BLAS"
    return str(_status)


def setup() -> BlasStatus:
    """Load the fastest BLAS we can find ahead of MLX.  Idempotent."""
    global _status
    if _status is None:
        _status = _setup()
    return _status


def _setup() -> BlasStatus:
    if os.environ.get("MLXQ_BLAS", "").lower() in ("off", "0", "no", "reference"):
        return BlasStatus(False, "fast BLAS disabled by MLXQ_BLAS=off; MLX uses its bundled BLAS")
    if sys.platform != "linux":
        return BlasStatus(False, f"platform {sys.platform}: MLX's own BLAS/Accelerate is used")
    if "mlx.core" in sys.modules:
        return BlasStatus(
            False,
            "mlx.core was imported before mlxq.worker.blas.setup(); the reference BLAS stays "
            "(call it first, or set LD_PRELOAD)",
        )
    steps: list[str] = []
    for path, kind in _candidates(steps):
        try:
            lib = _load(path, kind, steps)
        except OSError as exc:
            steps.append(f"{path}: {exc}")
            continue
        config = _openblas_config(lib)
        if not _resolves_globally(lib):
            steps.append(f"{path}: cblas_sgemm does not resolve to it globally")
            continue
        threads = _set_threads(lib)
        msg = (f"preloaded {config or 'OpenBLAS'} from {path} ({kind}) ahead of MLX's reference BLAS, "
               f"{threads} thread(s)")
        return BlasStatus(True, msg, library=path, config=config, steps=steps)
    return BlasStatus(
        False,
        "no usable OpenBLAS found; MLX keeps its reference BLAS (about 10x slower). "
        "Install mlxq's Linux dependencies or Debian's libopenblas0-pthread. Tried: "
        + "; ".join(steps or ["nothing"]),
        steps=steps,
    )


def _candidates(steps: list[str]):
    explicit = os.environ.get("MLXQ_BLAS_LIB")
    if explicit:
        yield explicit, "MLXQ_BLAS_LIB"
    for path in _SYSTEM_OPENBLAS:
        if os.path.exists(path):
            yield path, "system"
    found = ctypes.util.find_library("openblas")
    if found:
        yield found, "system"
    cmeel = _cmeel_openblas()
    if cmeel:
        if _cpu_runs_cmeel_build():
            yield cmeel, "cmeel-openblas wheel"
        else:
            steps.append(f"{cmeel}: built for AVX2+FMA, which this CPU lacks")


def _site_dirs() -> list[Path]:
    dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    dirs.update(p for p in sys.path if p.endswith("site-packages"))
    return [Path(d) for d in dirs if d and os.path.isdir(d)]


def _cmeel_openblas() -> str | None:
    for d in _site_dirs():
        hits = sorted(glob.glob(str(d / "cmeel.prefix" / "lib" / "libopenblas.so.0*")))
        if hits:
            return hits[0]
    return None


def _cpu_runs_cmeel_build() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _load(path: str, kind: str, steps: list[str]) -> ctypes.CDLL:
    if kind == "cmeel-openblas wheel" and not ctypes.util.find_library("gfortran"):
        _preload_bundled_gfortran(steps)
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _keep.append(lib)
    return lib


def _preload_bundled_gfortran(steps: list[str]) -> None:
    """Make ``libgfortran.so.5`` resolvable from the copy the mlx wheel ships.

    auditwheel renamed it (soname ``libgfortran-<hash>.so.5.0.0``), so a library
    that asks for ``libgfortran.so.5`` would not find it.  A copy whose soname
    is patched back to ``libgfortran.so.5``, loaded first, satisfies that.
    """
    for d in _site_dirs():
        libs = d / "mlx_cpu.libs"
        gfortran = sorted(libs.glob("libgfortran-*.so*"))
        if not gfortran:
            continue
        for quad in sorted(libs.glob("libquadmath-*.so*")):
            _keep.append(ctypes.CDLL(str(quad), mode=ctypes.RTLD_GLOBAL))
        cache = cache_dir() / "blas"
        cache.mkdir(parents=True, exist_ok=True)
        target = cache / "libgfortran.so.5"
        source = gfortran[0]
        stamp = cache / "libgfortran.source"
        if not target.exists() or not stamp.exists() or stamp.read_text() != str(source):
            tmp = cache / f".libgfortran.{os.getpid()}"
            shutil.copyfile(source, tmp)
            patch_soname(tmp, "libgfortran.so.5")
            os.replace(tmp, target)
            stamp.write_text(str(source))
        _keep.append(ctypes.CDLL(str(target), mode=ctypes.RTLD_GLOBAL))
        steps.append(f"libgfortran.so.5 from {source} (soname-patched copy {target})")
        return
    steps.append("no libgfortran.so.5 on the system nor in the mlx wheel")


def patch_soname(path: str | os.PathLike, new: str) -> None:
    """Rewrite the DT_SONAME string of a 64-bit little-endian ELF in place.

    The new name must not be longer than the old one; it is written over the
    old string in ``.dynstr``, so no section moves.
    """
    data = bytearray(Path(path).read_bytes())
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize
        )
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        raise ValueError(f"{path}: no dynamic section")
    strtab = soname = None
    for off in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        if tag == 5:
            strtab = val
        elif tag == 14:
            soname = val
    if strtab is None or soname is None:
        raise ValueError(f"{path}: no DT_STRTAB/DT_SONAME")
    base = next((off + strtab - va for va, off, size in loads if va <= strtab < va + size), None)
    if base is None:
        raise ValueError(f"{path}: DT_STRTAB outside any PT_LOAD segment")
    start = base + soname
    end = data.index(0, start)
    encoded = new.encode()
    if len(encoded) > end - start:
        raise ValueError(f"{path}: new soname longer than the old one")
    data[start : start + len(encoded) + 1] = encoded + b"\0"
    Path(path).write_bytes(bytes(data))


def default_threads() -> int:
    """All cores, as OpenBLAS itself would choose, measured end to end.

    On a quiet 2-core machine where the worker shares the cores with Valkey and the client
    (``bench/throughput.py --worker-blas-threads N``, 2026-11-22), 2 threads against 1 gave solo
    67 vs 48 tok/s, 16 jobs 497 vs 398, 64 jobs 728 vs 618: the Redis side needs little CPU.
    OpenBLAS's idle threads spin, though, so on a machine where *other* busy processes compete
    for the cores, 2 threads measured far worse (solo 8-14 tok/s against 38 with 1 thread):
    there, set ``MLXQ_BLAS_THREADS`` to the cores minus one.
    """
    return max(1, os.cpu_count() or 1)


def _set_threads(lib: ctypes.CDLL) -> int | str:
    """OpenBLAS threads: ``MLXQ_BLAS_THREADS=N``, else :func:`default_threads`.

    ``MLXQ_BLAS_THREADS=default`` leaves OpenBLAS's own default (all cores, or
    ``OPENBLAS_NUM_THREADS``): what a plain mlx-lm process with this BLAS gets.
    """
    want = os.environ.get("MLXQ_BLAS_THREADS") or default_threads()
    if str(want).lower() == "default":
        try:
            return int(lib.openblas_get_num_threads())
        except AttributeError:
            return "default"
    try:
        lib.openblas_set_num_threads(int(want))
        return int(lib.openblas_get_num_threads())
    except (AttributeError, ValueError):
        return "default"


def _openblas_config(lib: ctypes.CDLL) -> str | None:
    try:
        fn = lib.openblas_get_config
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode(errors="replace").strip()


def _resolves_globally(lib: ctypes.CDLL) -> bool:
    """True when ``cblas_sgemm`` looked up in the global scope is this library's."""
    try:
        ours = ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p).value
        glob_ = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        return False
    return ours == glob_
