"""``torch.compile`` with only the row dimension symbolic.

``torch.compile(fn, dynamic=True)`` makes every dimension symbolic, the vocabulary included, and
the generated kernels then compute their indices with run-time divisions by it. Measured on the
H200 (``benchmarks/compile_dynamic.py``, bf16, vocabulary 151,936): the logprob backward's
pointwise kernel took 2.05 ms per 4,096-row chunk that way and 0.98 ms with the vocabulary a
constant; the logprob statistics 1.25 against 0.85 ms; the engine's sampler 325 against 254 µs
for 512 rows. Marking only dimension 0 of the tensor arguments dynamic gives those kernels
while one compilation still serves every row count.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def compile_rows_dynamic(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled with shapes static except dimension 0 of each tensor argument.

    Dimension 0 is marked with ``maybe_mark_dynamic`` on every call, so the first compilation
    already treats it as symbolic (no recompilation when the row count changes; sizes 0 and 1
    may still get their own, as Dynamo specialises them).
    """
    compiled = torch.compile(fn, dynamic=None)

    def call(*args: Any) -> Any:
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call
