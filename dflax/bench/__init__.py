"""`dflax bench`: decode speed of methods on one prompt set, measured back to back in one run
(`run_bench`; the runners of each method and the summary rows in their own modules)."""

from dflax.bench.run import AUTO, BENCH_METHODS, run_bench

__all__ = ["AUTO", "BENCH_METHODS", "run_bench"]
