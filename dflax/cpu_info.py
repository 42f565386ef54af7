"""This machine's CPU as /proc/cpuinfo describes it: its model name and feature flags."""

from __future__ import annotations

import functools
import platform


@functools.cache
def cpu_model_and_flags() -> tuple[str, frozenset[str]]:
    """The first CPU's model name and feature flags from /proc/cpuinfo; `platform.processor()` and no flags
    where the file is missing (not Linux)."""
    model, flags = platform.processor(), frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == "model name":
                    model = value.strip()
                elif name.strip() == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return model, flags
