"""Compiles a kernel's C++ source into a shared library once per machine and registers it with XLA's FFI.

The library is cached in dflax's cache directory (`cpu_kernels/`), named by a hash of the source, the
headers beside it, the compiler flags and the jaxlib version, so a changed kernel, header or jaxlib
rebuilds it and parallel processes (pytest workers) share one build; `.ci/setup` builds them once
(`python -m dflax.cpu_kernels`). DFLAX_CPU_KERNELS=0 turns the kernels off (XLA's products
everywhere), for comparisons.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jaxlib

from dflax.cpu_info import cpu_model_and_flags
from dflax.paths import cache_dir

_FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC")


def cpu_has_avx2_fma() -> bool:
    """Whether this x86-64 CPU has AVX2 and FMA (read from /proc/cpuinfo; False elsewhere)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return {"avx2", "fma"} <= cpu_model_and_flags()[1]


def library_path(source: Path) -> Path:
    """Where the library built from `source` is cached: named by the source, the headers beside it (the
    kernels include them), the flags and jaxlib."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(
        source.read_bytes() + headers + " ".join(_FLAGS).encode() + jaxlib.__version__.encode()
    )
    return cache_dir() / "cpu_kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _compile(source: Path) -> Path:
    """The shared library built from `source`, compiled now unless the cache has it."""
    library = library_path(source)
    if library.exists():
        return library
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or clang++) on PATH")
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        built = Path(tmp) / library.name
        command = [compiler, *_FLAGS, "-isystem", jax.ffi.include_dir(), str(source), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, library)  # atomic: a concurrent build of the same source writes the same file
    return library


def kernel_sources() -> list[Path]:
    """The C++ sources of every CPU kernel (beside this file)."""
    return sorted(Path(__file__).parent.glob("*.cc"))


@functools.cache
def build_all() -> dict[str, str]:
    """Builds every kernel not yet in the cache, side by side (one compiler per source: about 6.5 s each on
    the 2-core CPU, so a first use waits for one build, not all of them in turn).

    Returns:
      {source name: the library's path, or why it was not built}.
    """
    if not cpu_has_avx2_fma():
        return {source.name: "this CPU lacks AVX2/FMA" for source in kernel_sources()}

    def build(source: Path) -> str:
        try:
            return str(_compile(source))
        except RuntimeError as error:
            return f"not built: {error}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(kernel_sources()) or 1) as pool:
        return dict(zip((s.name for s in kernel_sources()), pool.map(build, kernel_sources())))


@functools.cache
def load_kernel(source: Path, symbols: tuple[str, ...]) -> bool:
    """Builds `source` (once), registers its FFI handlers `symbols` for the CPU, and says whether it worked.

    False, with one warning naming the reason, when the kernels are turned off, the CPU lacks AVX2/FMA, or
    the build fails: callers then keep XLA's own product.
    """
    if os.environ.get("DFLAX_CPU_KERNELS", "1") == "0" or not cpu_has_avx2_fma():
        return False
    build_all()  # every kernel at once, the first time any is needed
    try:
        library = ctypes.cdll.LoadLibrary(str(_compile(source)))
    except (OSError, RuntimeError) as error:
        message = f"dflax: {source.name} not built, XLA's own products are used instead: {error}"
        warnings.warn(message, stacklevel=2)
        return False
    for symbol in symbols:
        jax.ffi.register_ffi_target(symbol, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return True
