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


def compile_rows_dynamic(fn: Callable[..., Any], dims: dict[int, tuple[int, ...]] | None = None) -> Callable[..., Any]:
    """``fn`` compiled with shapes static except dimension 0 of each tensor argument, or, with
    ``dims``, except the listed dimensions of the listed positional arguments (``{1: (0,), 9: (0, 3)}``).

    The dimensions are marked with ``maybe_mark_dynamic`` on every call, so the first compilation
    already treats them as symbolic (no recompilation when they change; sizes 0 and 1 may still
    get their own, as Dynamo specialises them).
    """
    compiled = torch.compile(fn, dynamic=None)

    def call(*args: Any) -> Any:
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor) or a.dim() == 0:
                continue
            for d in ((0,) if dims is None else dims.get(i, ())):
                torch._dynamo.maybe_mark_dynamic(a, d)
        return compiled(*args)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call
