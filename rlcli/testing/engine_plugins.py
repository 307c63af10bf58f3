"""Test helpers for engine plugins (``rlcli-vllm``, ``rlcli-sglang``, ``rlcli-lmdeploy`` or a third
party's backend built on :class:`rlcli.backends.engine_runtime.EngineBackend`).

* :func:`skip_gpu_tests_without_engine` - a ``pytest_collection_modifyitems`` body that skips a
  plugin's ``gpu``-marked tests with the exact reason (engine not installed, no CUDA);
* :func:`fake_next_token` / :func:`fake_token_logprob` / :func:`fake_expected` - a deterministic
  token model for CPU stand-ins of an engine, so tests can predict every token and logprob;
* :func:`cpu_context` - a :class:`BackendContext` on the CPU with a given EOS id;
* :func:`check_quickstart_with_defaults` - (GPU) train ``recipes/quickstart.yaml`` for a few steps
  through an engine plugin at its default options; its KV cache must hold the recipe's workload
  within the budget sized from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

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


def check_quickstart_with_defaults(backend: str, work_dir: str | Path, engine_kv_tokens: Callable[[Any], int | None],
                                   overrides: Iterable[str] = (), steps: int = 3) -> dict[str, float]:
    """Train the repository's ``recipes/quickstart.yaml`` with ``rollout.name=<backend>`` on CUDA for
    ``steps`` steps, every other rollout option at the plugin's default (so the KV cache is sized from
    the recipe), plus ``overrides``. Checks that the run finishes, that the backend planned its KV
    cache from the workload (``backend.kv_plan``) and that the cache the engine reports
    (``engine_kv_tokens(backend)``, None when it cannot tell) holds every sequence in flight at once
    and stays within the plan. Returns the last step's metrics."""
    from rlcli.config import load_recipe
    from rlcli.runner.colocate import ColocateRunner

    recipe_path = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    recipe = load_recipe(recipe_path, ["resources.device=cuda", f"rollout.name={backend}",
                                       f"trainer.total_train_steps={steps}", f"trainer.work_dir={work_dir}",
                                       *overrides])
    runner = ColocateRunner(recipe, quiet=True)
    try:
        plan, workload = runner.backend.kv_plan, runner.backend.ctx.workload
        assert workload is not None and plan is not None, "the KV cache was not sized from the recipe"
        need = workload.max_sequences * workload.max_sequence_tokens
        reported = engine_kv_tokens(runner.backend)
        if reported is not None:
            assert need <= reported <= plan.tokens, (need, reported, plan.describe())
        metrics = runner.fit()
    finally:
        runner.close()
    assert runner.step == steps
    return metrics
