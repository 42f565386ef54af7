"""The compiler's own numbers of a compiled program: memory_analysis and cost_analysis, as one record."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class CompiledNumbers:
    """What XLA reports for one compiled executable (bytes per device).

    Attributes:
      argument_bytes: inputs (parameters, caches, state).
      output_bytes: outputs.
      alias_bytes: outputs that reuse donated input buffers (counted in both of the above).
      temp_bytes: scratch the program allocates while it runs.
      code_bytes: generated code.
      flops: floating-point operations (cost_analysis; one iteration of a while loop's body).
      bytes_accessed: memory traffic the cost model expects.
      optimal_seconds: the cost model's lower-bound run time (None where the compiler gives none).
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float
    bytes_accessed: float
    optimal_seconds: float | None

    @property
    def peak_bytes(self) -> int:
        """Live memory while the program runs: arguments, outputs not aliased to them, and temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @classmethod
    def of(cls, compiled: Any) -> CompiledNumbers:
        """Reads a `jax.stages.Compiled`'s memory_analysis() and cost_analysis()."""
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis() or {}
        if isinstance(cost, list):  # older jax returns one dict per program
            cost = cost[0] if cost else {}
        optimal = cost.get("optimal_seconds")
        return cls(
            argument_bytes=int(memory.argument_size_in_bytes),
            output_bytes=int(memory.output_size_in_bytes),
            alias_bytes=int(memory.alias_size_in_bytes),
            temp_bytes=int(memory.temp_size_in_bytes),
            code_bytes=int(memory.generated_code_size_in_bytes),
            flops=float(cost.get("flops", 0.0)),
            bytes_accessed=float(cost.get("bytes accessed", 0.0)),
            optimal_seconds=None if optimal is None or optimal < 0 else float(optimal),
        )


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


TABLE_HEADER = "| config | stage | arguments MiB | outputs MiB | temp MiB | peak MiB | GFLOP | GB accessed |"


def table_row(config: str, stage: str, numbers: CompiledNumbers) -> str:
    """One markdown row of `TABLE_HEADER`."""
    cells = (
        config,
        stage,
        _mib(numbers.argument_bytes),
        _mib(numbers.output_bytes),
        _mib(numbers.temp_bytes),
        _mib(numbers.peak_bytes),
        f"{numbers.flops / 1e9:,.2f}",
        f"{numbers.bytes_accessed / 1e9:,.3f}",
    )
    return "| " + " | ".join(cells) + " |"


def markdown_table(rows: Sequence[tuple[str, str, CompiledNumbers]]) -> str:
    """A markdown table of (config, stage, numbers) rows."""
    separator = "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"
    return "\n".join([TABLE_HEADER, separator, *(table_row(*row) for row in rows)])
