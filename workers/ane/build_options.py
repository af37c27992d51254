"""`BuildOptions`: the test-only graph degradations (importable without coremltools: the
worker parses them from argv before HELLO)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BuildOptions:
    """Test-only degradations for certification (defaults build the faithful graph).

    ln_eps_override: use this layer-norm epsilon instead of max(config eps, LN_EPS_FLOOR).
    weight_mantissa_bits: truncate every weight's float32 mantissa to this many bits (toward
        zero) before the graph is built; fp16 keeps 10, so values < 10 degrade visibly.
    """

    ln_eps_override: float | None = None
    weight_mantissa_bits: int | None = None

    def __post_init__(self) -> None:
        if self.weight_mantissa_bits is not None and not 0 <= self.weight_mantissa_bits <= 23:
            raise ValueError("weight_mantissa_bits must be in 0..23")

    def key_fields(self) -> dict[str, object]:
        """Non-default options, for the compile-cache key (defaults add nothing)."""
        out: dict[str, object] = {}
        if self.ln_eps_override is not None:
            out["ln_eps_override"] = float(self.ln_eps_override)
        if self.weight_mantissa_bits is not None:
            out["weight_mantissa_bits"] = int(self.weight_mantissa_bits)
        return out
