"""The seed mixing step shared by the backends: the embedded engine's sampling keys and default
request seeds (:mod:`rlcli.backends.embedded`) and the engine runtime's default request seeds
(:class:`rlcli.backends.engine_runtime.SeedSequence`) are all derived with :func:`splitmix64`."""

from __future__ import annotations

M64 = 0xFFFFFFFFFFFFFFFF


def splitmix64(x: int) -> int:
    """One step of the splitmix64 generator (exact Python integer arithmetic)."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)
