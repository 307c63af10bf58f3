"""What is due at a training step: weight sync, evaluation, checkpoint, HF export.

Both runners ask one :class:`Schedule`, built from the recipe's ``trainer`` section, so that a
colocated and a disaggregated run of the same recipe sync, evaluate, save and export at the same
steps. Steps count from 1; step 0 is "before training" (the initial evaluation only).

A sync point is a multiple of ``sync_weights_interval`` or the last step; a disaggregated run also
syncs early when a producer waits for newer weights (``expired``). Evaluation and checkpoints
happen only at sync points (the recipe rules make their intervals multiples of
``sync_weights_interval``); an HF export is due every ``hf_interval`` steps and at the last step.
An interval of ``None``, 0 or a negative number disables checkpoints and periodic HF exports.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlcli.config import EvalConfig, TaskConfig, TrainerConfig


def share(total: int, index: int, count: int) -> int:
    """Part ``index`` of ``total`` items split over ``count`` parts as evenly as possible (the first
    ``total % count`` parts get one more): a rank's groups of a step, or its eval prompts."""
    return total // count + (index < total % count)


def total_train_steps(cfg: TrainerConfig, tasks: list[TaskConfig], tokenizer) -> int:
    """``trainer.total_train_steps``, else the prompts of ``tasks`` // train_batch_size × total_epochs
    (at least 1)."""
    if cfg.total_train_steps is not None:
        return cfg.total_train_steps
    n_prompts = sum(len(tc.sampler.build(tokenizer=tokenizer, task_name=tc.task_name, seed=0))
                    for tc in tasks)
    return max(1, n_prompts // cfg.train_batch_size * cfg.total_epochs)


def _every(interval: int | None, step: int) -> bool:
    return interval is not None and interval > 0 and step % interval == 0


@dataclass(frozen=True)
class Schedule:
    total_steps: int
    sync_interval: int = 1  # trainer.sync_weights_interval
    evaluate: bool = False  # trainer.enable_evaluate, with eval tasks to run
    initial_evaluate: bool = False  # trainer.enable_initial_evaluate
    evaluate_step: int | None = 1
    checkpoint_interval: int | None = -1
    hf_interval: int | None = -1

    @classmethod
    def of(cls, cfg: TrainerConfig, eval_cfg: EvalConfig | None, total_steps: int) -> Schedule:
        """The schedule of the recipe's ``trainer`` section (``eval``: whether there are eval tasks to run)."""
        return cls(
            total_steps=total_steps, sync_interval=cfg.sync_weights_interval,
            evaluate=bool(cfg.enable_evaluate and eval_cfg is not None and eval_cfg.tasks),
            initial_evaluate=cfg.enable_initial_evaluate, evaluate_step=cfg.evaluate_step,
            checkpoint_interval=cfg.checkpoint_interval, hf_interval=cfg.hf_interval,
        )

    def last(self, step: int) -> bool:
        return step == self.total_steps

    def sync_due(self, step: int, *, expired: bool = False) -> bool:
        """Push the weights to the inference side after training ``step``: every ``sync_interval`` steps,
        at the last step, and whenever a producer waits for newer weights (``expired``)."""
        return expired or step % self.sync_interval == 0 or self.last(step)

    def early_sync(self, step: int, *, expired: bool) -> bool:
        """A sync that only a waiting producer asked for (``sync/early``)."""
        return expired and not self.sync_due(step)

    def initial_eval_due(self, step: int) -> bool:
        """Evaluate before the first step (a run that starts at step 0, not a resumed one)."""
        return self.evaluate and self.initial_evaluate and step == 0

    def eval_due(self, step: int, *, expired: bool = False) -> bool:
        """Evaluate after ``step``: at sync points every ``evaluate_step`` steps, and at the last step."""
        return (self.evaluate and self.sync_due(step, expired=expired)
                and (step % self.evaluate_step == 0 or self.last(step)))

    def checkpoint_due(self, step: int, *, expired: bool = False) -> bool:
        """Save a checkpoint after ``step``: at sync points every ``checkpoint_interval`` steps (none when
        the interval is ``None``/0/negative; the last step gets none of its own)."""
        return self.sync_due(step, expired=expired) and _every(self.checkpoint_interval, step)

    def hf_export_due(self, step: int) -> bool:
        """Export a Hugging Face model after ``step``: every ``hf_interval`` steps and at the last step."""
        return _every(self.hf_interval, step) or self.last(step)

    def model_step(self, step: int) -> int:
        """The policy version rolling out ``step`` in lock-step (colocated): the last sync at or before
        ``step - 1``."""
        return (step - 1) - ((step - 1) % self.sync_interval)
