"""``torch.compile`` helpers: only the row dimension symbolic; decoder layers under a memory budget.

:func:`compile_rows_dynamic`: ``torch.compile(fn, dynamic=True)`` makes every dimension
symbolic, the vocabulary included, and the generated kernels then compute their indices with
run-time divisions by it. Measured on the H200 (``benchmarks/compile_dynamic.py``, bf16,
vocabulary 151,936): the logprob backward's pointwise kernel took 2.05 ms per 4,096-row chunk
that way and 0.98 ms with the vocabulary a constant; the logprob statistics 1.25 against
0.85 ms; the engine's sampler 325 against 254 µs for 512 rows. Marking only dimension 0 of the
tensor arguments dynamic gives those kernels while one compilation still serves every row count.

:func:`layer_compile_kwargs`: the ``nn.Module.compile`` arguments of a trained decoder layer under
``train_worker.fsdp.activation_memory_budget``.
"""

from __future__ import annotations

import functools
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


@functools.cache
def _inductor_with_budget(budget: float):
    """Inductor, partitioning forward and backward under ``activation_memory_budget``.

    The budget is a global functorch setting that compiled graphs are not keyed on, so a plain
    ``torch.compile`` would silently reuse a graph partitioned under another budget (a second
    TrainWorker in the process, say). One backend object per budget keeps them apart: Dynamo
    recompiles when the backend differs.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    return backend


def layer_compile_kwargs(budget: float) -> dict[str, Any]:
    """Keyword arguments for ``layer.compile``: none at a budget of 1 (or more), else Inductor under ``budget``."""
    return {} if budget >= 1 else {"backend": _inductor_with_budget(float(budget))}

