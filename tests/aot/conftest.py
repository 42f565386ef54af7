"""TPU topologies for compile-only tests: libtpu starts once per session, and the tests skip (with the
reason) only where libtpu is not installed."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def tpu_device():
    """tpu_device(topology="v5e:2x2") -> the first TPU device of that slice, to compile for."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip(
            "libtpu is not installed (bash .ci/setup --test installs it: pip install 'dflax[tpu-aot]')"
        )
    from dflax.aot.topology import tpu_topology

    return lambda topology="v5e:2x2": tpu_topology(topology).devices[0]
