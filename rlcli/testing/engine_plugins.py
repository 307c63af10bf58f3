"""Test helpers for engine plugins (``rlcli-vllm``, ``rlcli-sglang``, ``rlcli-lmdeploy`` or a third
party's backend built on :class:`rlcli.backends.engine_runtime.EngineBackend`).

* :func:`skip_gpu_tests_without_engine` - a ``pytest_collection_modifyitems`` body that skips a
  plugin's ``gpu``-marked tests with the exact reason (engine not installed, no CUDA);
* :func:`fake_next_token` / :func:`fake_token_logprob` / :func:`fake_expected` - a deterministic
  token model for CPU stand-ins of an engine, so tests can predict every token and logprob;
* :func:`cpu_context` - a :class:`BackendContext` on the CPU with a given EOS id.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch

from rlcli.backends.base import BackendContext

if TYPE_CHECKING:
    from rlcli.backends.engine_runtime import EnginePackage


def gpu_skip_reason(engine: "EnginePackage") -> str | None:
    """Why tests that drive the real engine cannot run here (None when they can)."""
    problem = engine.problem()
    if problem is not None:
        return problem
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


def skip_gpu_tests_without_engine(engine: "EnginePackage", items: list, test_dir: str | Path) -> None:
    """Skip the ``gpu``-marked tests under ``test_dir`` with :func:`gpu_skip_reason` (call it from
    the plugin's ``conftest.py`` ``pytest_collection_modifyitems``; a conftest hook sees every item
    of the session, so only the tests below ``test_dir`` are touched)."""
    import pytest

    here = Path(test_dir).resolve()
    ours = [it for it in items if "gpu" in it.keywords and here in Path(str(it.path)).resolve().parents]
    reason = gpu_skip_reason(engine) if ours else None
    if reason:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=reason), append=False)  # first: the most specific reason


def fake_next_token(context: list[int], shift: int, vocab: int) -> int:
    """The token a stand-in engine emits after ``context`` (a hash of its last four tokens;
    ``shift`` stands for the weights: a weight update changes it)."""
    h = shift
    for t in context[-4:]:
        h = (h * 1_000_003 + t + 7) % 2_147_483_647
    return h % vocab


def fake_token_logprob(tok: int) -> float:
    """The logprob a stand-in engine reports for token ``tok``."""
    return -0.05 * (1 + tok % 13)


def fake_expected(prompt: Iterable[int], n: int, vocab: int, shift: int = 0, stops: Iterable[int] = ()) -> list[int]:
    """The first ``n`` tokens a stand-in engine generates for ``prompt`` (up to the first of ``stops``)."""
    out, ctx, stops = [], list(prompt), set(stops)
    for _ in range(n):
        t = fake_next_token(ctx, shift, vocab)
        out.append(t)
        ctx.append(t)
        if t in stops:
            break
    return out


def cpu_context(model_dir: str | Path, eos: int = 2, version: int = 0,
                dtype: torch.dtype = torch.bfloat16) -> BackendContext:
    """A CPU :class:`BackendContext` with one EOS id."""
    return BackendContext(model_dir=str(model_dir), device=torch.device("cpu"), dtype=dtype,
                          eos_token_ids=[eos], seed=0, version=version)
