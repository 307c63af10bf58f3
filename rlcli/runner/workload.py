"""What a run asks of one inference-backend replica at most at once (:class:`RolloutWorkload`),
from the recipe and the prepared data: the engine plugins size their KV cache from it.

* Training: every training task rolls out its share of the replica's ``train_batch_size`` groups
  at once (the sync strategy launches exactly them; the async one at most
  ``ceil(over_sample_threshold x share)`` more), all tasks together; each group is
  ``prompt_repeat_k`` sequences.
* Evaluation: each eval task's prompts of this replica (``eval.evaluator.sample_num`` /
  ``sample_ratio`` / all) are sent at once, one task after another.
* Length: the longest prompt of a task's data (else its sampler's ``max_prompt_length``) plus its
  ``sample_params.max_tokens`` (the budget of the whole response, inserted tool tokens included).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from rlcli.backends.base import RolloutWorkload
from rlcli.config import TaskConfig, task_max_tokens
from rlcli.config.fit import allocate_task_batch_sizes
from rlcli.runner.schedule import share


def eval_prompt_count(evaluator: Any, sampler: Any) -> int:
    """Eval prompts of ``sampler`` used per evaluation (all replicas): ``sample_num``, else
    ``sample_ratio`` of them, else all."""
    n = len(sampler)
    if evaluator is not None and evaluator.sample_num > 0:
        return min(evaluator.sample_num, n)
    if evaluator is not None and evaluator.sample_ratio > 0:
        return max(1, int(n * evaluator.sample_ratio))
    return n


def _group_size(tc: TaskConfig) -> int:
    return int(getattr(tc.sampler.cfg, "prompt_repeat_k", 1) or 1)


def _sequence_tokens(tc: TaskConfig, sampler: Any) -> int | None:
    """Prompt + response tokens of the task's longest sequence; None when unknown."""
    max_tokens = task_max_tokens(tc.agent_loop.cfg)
    lengths = sampler.prompt_lengths() if hasattr(sampler, "prompt_lengths") else None
    longest = max(lengths) if lengths else getattr(tc.sampler.cfg, "max_prompt_length", None)
    if max_tokens is None or not isinstance(longest, int):
        return None
    return longest + max_tokens


def rollout_workload(prepared: Sequence[tuple[TaskConfig, Any]], train_tasks: Sequence[TaskConfig],
                     train_batch_size: int, evaluator: Any, shard: tuple[int, int]) -> RolloutWorkload | None:
    """The workload of replica ``shard=(index, count)`` for the tasks whose samplers it ``prepared``
    (``(task config, sampler)`` pairs; those in ``train_tasks`` train, the others are eval tasks);
    None when it rolls out nothing."""
    index, count = shard
    train = [(tc, s) for tc, s in prepared if any(tc is t for t in train_tasks)]
    evals = [(tc, s) for tc, s in prepared if not any(tc is t for t in train_tasks)]
    in_train = 0
    if train:
        sizes = allocate_task_batch_sizes(share(train_batch_size, index, count),
                                          {tc.task_name: tc.weight for tc, _ in train})
        for tc, _ in train:
            groups = sizes[tc.task_name]
            groups += math.ceil(float(getattr(tc.produce_strategy.cfg, "over_sample_threshold", 0.0)) * groups)
            in_train += groups * _group_size(tc)
    in_eval = max((share(eval_prompt_count(evaluator, s), index, count) * _group_size(tc) for tc, s in evals),
                  default=0)
    sequences = max(in_train, in_eval)
    if sequences <= 0:
        return None
    lengths = [_sequence_tokens(tc, s) for tc, s in prepared]
    longest = None if not lengths or None in lengths else max(lengths)
    return RolloutWorkload(max_sequences=sequences, max_sequence_tokens=longest, train_sequences=in_train)
