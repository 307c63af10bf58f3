"""Evaluation during training and in ``rlcli eval``: the recipe's eval tasks on the same fixed prompts
every time, reduced to ``eval/...`` metrics."""

from __future__ import annotations

import asyncio

from rlcli.agent_loops.base import AgentLoop, run_group_isolated
from rlcli.config import EvalConfig
from rlcli.dist import rank, world_size
from rlcli.produce.manager import engine_metrics
from rlcli.runner.setup import Environment, build_tasks
from rlcli.runner.workload import eval_prompt_count
from rlcli.types import Sample


class Evaluator:
    """Runs the recipe's eval tasks (its ``eval`` section) on the same fixed prompts every time and
    reduces metrics.

    ``sync_weights_interval``: ``trainer.sync_weights_interval`` (the tasks' produce strategies are
    built with it). ``shard=(index, count)``: the share of the eval prompts this process rolls out
    (default: its rank among all ranks, i.e. every rank evaluates).
    """

    def __init__(self, env: Environment, eval_cfg: EvalConfig, backend, *, sync_weights_interval: int,
                 shard: tuple[int, int] | None = None):
        self.env = env
        self.eval_cfg = eval_cfg
        self.shard = shard
        self.tasks, self.pools = build_tasks(env, eval_cfg.tasks, backend, salt="eval",
                                             sync_weights_interval=sync_weights_interval, eval_mode=True, shard=shard)
        self.metric_components = [m.build() for m in eval_cfg.evaluator.metrics]
        self.backend = backend

    def _shard(self) -> tuple[int, int]:
        return self.shard if self.shard is not None else (rank(), world_size())

    def num_groups(self) -> int:
        """Eval prompts this rank rolls out."""
        index, count = self._shard()
        total = 0
        for t in self.tasks:
            n = self._num_prompts(t.sampler)
            total += len(range(index, n, count))
        return total

    def _num_prompts(self, sampler) -> int:
        return eval_prompt_count(self.eval_cfg.evaluator, sampler)

    async def run(self, step: int, progress=None) -> list[Sample]:
        """Roll out and judge this rank's share of every eval task's prompts."""
        self.backend.resume()
        samples: list[Sample] = []
        for task in self.tasks:
            groups = task.sampler.fixed_groups(self._num_prompts(task.sampler), shard=self._shard())
            for g in groups:  # eval seeds differ per step
                for s in g:
                    s.tries = step
            for fut in asyncio.as_completed([run_group_isolated(task.agent_loop, g) for g in groups]):
                await fut
                if progress is not None:
                    progress(1)
            samples += [s for g in groups for s in g]
        return samples

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        """Evaluator metrics over all ranks' samples (``eval/<task>/...`` when there are several tasks)."""
        return eval_metrics(samples, [t.name for t in self.tasks], self.metric_components)

    def pop_stats(self) -> dict[str, float]:
        """The eval judgers' and agent loops' counters and the backend's (``eval/engine/*``) since the last call."""
        out: dict[str, float] = {}
        loops = [t.agent_loop for t in self.tasks if isinstance(t.agent_loop, AgentLoop)]
        for part in [*self.pools, *loops]:  # judger/* and agent_loop/errors
            for k, v in part.pop_stats().items():
                out[f"eval/{k}"] = out.get(f"eval/{k}", 0.0) + v
        out.update(engine_metrics(self.backend, "eval/engine/"))
        return out

    def close(self) -> None:
        for p in self.pools:
            p.close()


def eval_metrics(samples: list[Sample], task_names: list[str], components: list) -> dict[str, float]:
    """Evaluator metrics of the eval tasks ``task_names`` (``eval/<task>/...`` when there are several)."""
    from rlcli.evaluator import evaluate

    out: dict[str, float] = {}
    for name in task_names:
        mine = sorted((s for s in samples if s.task_name == name), key=lambda s: s.uid)
        prefix = "eval/" if len(task_names) == 1 else f"eval/{name}/"
        out.update({prefix + k: v for k, v in evaluate(mine, components).items()})
    if len(task_names) > 1:
        out.update({f"eval/{k}": v for k, v in evaluate(samples, components).items()})
    return out
