"""Shared fixtures: tiny checkpoints are built once per session and reused by every test."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# Tests run on the CPU in float32; keep XLA from grabbing every core for one op.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# About three quarters of the suite's time is XLA compiling programs that run for milliseconds. LLVM without
# its expensive passes compiles them ~20% faster (tests/drafters/test_dflash_lossless.py alone: 172 -> 140 s
# on a 2-core Zen 3 EPYC, 2026-12-03); XLA's own HLO passes, so what the programs compute and the in-place
# cache updates the tests read from the HLO, are unchanged. Speed is `dflax bench`'s, which runs without it.
# Subprocesses inherit it (tests that add flags append to these).
TEST_XLA_FLAGS = "--xla_llvm_disable_expensive_passes=true --xla_backend_optimization_level=0"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
# Every run gets one empty dflax cache (GGUF conversions, tokenizers, joined model files, CPU kernels), so
# nothing a previous run or another checkout converted can stand in for what this code converts. The
# process that makes it (pytest alone, or the xdist controller) owns it and removes it at exit; xdist workers
# and the subprocesses tests start inherit it, so each conversion is done once per run rather than once per
# worker (the cache's writes are atomic renames, so two workers converting the same file at once is safe).
# Set before dflax is imported.
_CACHE_OWNER = "DFLAX_TEST_CACHE_OWNER"
if os.environ.get(_CACHE_OWNER) is None:
    os.environ["DFLAX_CACHE"] = tempfile.mkdtemp(prefix="dflax-test-cache-")
    os.environ[_CACHE_OWNER] = str(os.getpid())
    atexit.register(shutil.rmtree, os.environ["DFLAX_CACHE"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(name) -> (path of a saved tiny HF checkpoint, the torch model)."""
    from tiny_checkpoints import save_tiny_checkpoint

    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            built[name] = (path, save_tiny_checkpoint(name, path))
        return built[name]

    return get


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target (float32), loaded once per session."""
    import dflax

    return dflax.load_target("smollm2-135m")


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs_after_each_module():
    """Drops jax's compiled programs after every test module.

    Each XLA:CPU executable holds about three memory mappings until it is freed, and the suite compiles
    thousands of programs in one process: kept, they grew past 11k mappings within the first 77 tests,
    reached the kernel's `vm.max_map_count` (65530) and XLA aborted the interpreter at ~94% of the suite.
    Programs a later module needs are compiled again, which costs seconds per module.
    """
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session", autouse=True)
def no_persistent_compilation_cache_in_this_process():
    """Keeps the CLI's in-process calls from turning on XLA's persistent compilation cache for the whole run.

    The cache is a process-wide jax setting: once an in-process `dflax` command enabled it, every later
    compile of the suite would be serialized and written to disk, time no test asks for. Commands the
    tests start as subprocesses still use it, sharing this run's DFLAX_CACHE.
    """
    from dflax import paths

    def cache_directory_left_off():
        return paths.cache_dir() / "xla"

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paths, "enable_compilation_cache", cache_directory_left_off)
        yield
