"""The sampler contract: what rlcli asks of a component of kind ``sampler``."""

from __future__ import annotations

import abc
from typing import Any

from rlcli.component import Component
from rlcli.types import Sample


class DataError(ValueError):
    """A dataset a run cannot use: the message names the task and the file (``rlcli train`` exits 2)."""


class Sampler(Component, abc.ABC):
    """Reads one task's dataset and hands out its prompts as groups of samples.

    Built once per task (train and eval tasks alike) as
    ``cls(config, tokenizer=..., task_name=..., seed=...)``: ``seed`` is the trainer seed, the
    default for any shuffling. Every sample a sampler returns is fresh (no response yet), carries
    ``task_name`` and the tokenized ``prompt_ids`` (with ``messages``/``prompt_text`` for
    multi-turn loops and logs) and the ``label`` the judger scores against; the samples of one
    group share a ``group_id`` (the group the advantage estimator normalises over).

    What rlcli calls:

    - ``sample_group()``: the next group of the training stream, which never runs out (start a
      new epoch instead). The produce strategies call it whenever they need another prompt,
      also to replace a group a filter dropped.
    - ``fixed_groups(n, shard=(index, count))``: evaluation, the same ``n`` prompts (all when
      ``n`` is None) every time; with ``shard`` only this process's part, group ids staying
      those of the unsharded set.
    - ``len(sampler)``: the number of prompts (epochs, ``eval.evaluator.sample_ratio``).
    - ``pop_stats()``: counters since the last call (say rows skipped), logged with the step's
      metrics; the default reports none.
    - ``prompt_lengths()``: the tokens of every prompt, or None (the default) when unknown.
    - ``skipped_rows()``: every row of the dataset left out, each with ``file``, ``line``,
      ``kind`` and ``reason`` (:class:`rlcli.data.rows.SkippedRow`); the runner writes them to
      ``skipped_rows.jsonl`` in the work dir. The default reports none.
    - ``state_dict()`` / ``load_state_dict(state)``: the position in the stream, saved in every
      checkpoint (plain Python values) so a resumed run hands out the groups an uninterrupted
      run would have; refuse a state that does not fit (other data, other ranks).

    A dataset the sampler cannot use at all (no usable prompt, an unreadable file) raises
    :class:`DataError` from the constructor, which the runner calls before any model loads.

    Optional: ``shard(index, count)``, called right after construction with this process's
    place among the ``count`` processes that roll out, so that each hands out its own share of
    the stream with group ids unique across them. A sampler without it hands every process the
    whole stream.
    """

    @abc.abstractmethod
    def sample_group(self) -> list[Sample]:
        """The next prompt of the endless training stream, as a group of fresh samples."""

    @abc.abstractmethod
    def fixed_groups(self, n: int | None = None, shard: tuple[int, int] = (0, 1)) -> list[list[Sample]]:
        """The first ``n`` prompts (all when None), the same every call; with ``shard=(index,
        count)`` only every ``count``-th of them from ``index``."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of prompts."""

    def pop_stats(self) -> dict[str, float]:
        """Counters since the last call, reported once (``data/...`` metric names)."""
        return {}

    def prompt_lengths(self) -> list[int] | None:
        """The number of tokens of every prompt (None: not known). The runner checks them against
        the model's context and ``pack_max_length`` before any model loads."""
        return None

    def skipped_rows(self) -> list[Any]:
        """Every row left out of the dataset (``file``, ``line``, ``kind``, ``reason`` each)."""
        return []

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The position in the stream (plain Python values), saved in checkpoints."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; raise ``ValueError`` on a state that does not fit."""
