"""Build and load kvpager's C++ CPU kernels (common.h, layers.cpp, attention.cpp) with the system compiler.

The library is compiled once per (source, compiler flags, CPU feature set) into a cache directory
(`$KVPAGER_CACHE_DIR/kernels`, default `~/.cache/kvpager/kernels`) and loaded with ctypes. No torch
headers are involved, so a build takes seconds. `load_cpu_kernels()` raises KernelBuildError (with
the reason) when no compiler is available or the build fails; `select_ops("auto", ...)` then keeps the
torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent
SOURCES = (
    KERNEL_DIR / "layers.cpp",
    KERNEL_DIR / "linear.cpp",
    KERNEL_DIR / "attention.cpp",
    KERNEL_DIR / "prefill.cpp",
)
HEADERS = (KERNEL_DIR / "common.h",)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC", "-std=c++17")

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
SIGNATURES: dict[str, tuple[object, ...]] = {
    "kvp_set_num_threads": (_I,),
    "kvp_max_threads": (),
    "kvp_linear_small": (_P, _I, _I, _P, _I, _P, _P),
    "kvp_linear_b": (_P, _I, _I, _P, _I, _I, _P, _P),
    "kvp_linear_b_fast": (),
    "kvp_unblock": (_P, _I, _I, _I, _P),
    "kvp_rms_norm": (_P, _I, _P, _P, _I, _I, _I, _F),
    "kvp_add_rms_norm": (_P, _P, _P, _P, _I, _I, _F),
    "kvp_silu_mul": (_P, _P, _I, _I),
    "kvp_rope_and_cache": (_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _F, _P, _P, _P, _I),
    "kvp_decode_layers": (
        _P,
        _P,
        _I,
        _I,
        _I,
        _P,
        _I,
        _I,
        _I,
        _I,
        _F,
        _P,
        _I,
        _I,
        _P,
        _P,
        _P,
        _P,
        _I,
        _P,
        _I,
        _F,
        _I,
        _P,
        _I,
    ),
    "kvp_paged_decode": (_P, _I, _P, _I, _P, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _I, _F, _I, _I),
    "kvp_prefill_attention": (_P, _I, _P, _I, _I, _P, _P, _P, _I, _I, _I, _P, _P, _I, _P, _I, _I, _F, _I),
}
RETURNS_INT = ("kvp_max_threads", "kvp_prefill_attention", "kvp_linear_b_fast")  # the others return nothing


@dataclass(frozen=True)
class KernelLibrary:
    """The loaded shared library: one ctypes function per kernel, argument types set."""

    path: Path
    lib: ctypes.CDLL

    def fn(self, name: str) -> Any:
        return getattr(self.lib, name)


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded (no compiler, compile error, load error)."""


def cache_dir() -> Path:
    root = os.environ.get("KVPAGER_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "kvpager"
    return base / "kernels"


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise KernelBuildError("no C++ compiler found (set CXX, or install g++); using the torch path")


def _cpu_features() -> str:
    """The CPU's feature flags: -march=native code must not run on another CPU sharing the cache."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key(compiler: str) -> str:
    h = hashlib.sha256()
    parts = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    for part in (*parts, " ".join(FLAGS).encode(), compiler.encode(), _cpu_features().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def build(force: bool = False) -> Path:
    """Compile the kernels unless the cached library for these sources/flags/CPU exists; return its path."""
    compiler = _compiler()
    out_dir = cache_dir() / build_key(compiler)
    target = out_dir / "libkvpager_cpu.so"
    if target.exists() and not force:
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: compile to a temporary name, then rename: concurrent builders never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [compiler, *FLAGS, *(str(p) for p in SOURCES), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise KernelBuildError(f"compiling the CPU kernels failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built CPU kernels: %s", target)
    return target


@functools.cache
def load_cpu_kernels() -> KernelLibrary:
    """Build (once per process and per machine) and load the kernels. Raises KernelBuildError."""
    import torch  # noqa: F401  NOTE: torch's libgomp must be loaded first so the kernels share its thread pool

    path = build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(f"loading {path} failed: {exc}") from exc
    for name, argtypes in SIGNATURES.items():
        f = getattr(lib, name)
        f.argtypes = list(argtypes)
        f.restype = ctypes.c_int64 if name in RETURNS_INT else None
    return KernelLibrary(path, lib)
