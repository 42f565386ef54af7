"""Walking a jaxpr: tests that check which primitives a program is made of."""

from collections.abc import Iterator

import jax


def equations(jaxpr) -> Iterator:
    """Every equation of a jaxpr and of the jaxprs inside it (loops, jits), depth first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from equations(sub)
