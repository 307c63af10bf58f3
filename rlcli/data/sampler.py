"""The ``jsonl``, ``parquet`` and ``hf_dataset`` samplers: RL prompts handed out as groups of
``prompt_repeat_k``. They differ only in where the rows come from (:meth:`RowSampler.read`);
everything after reading is one code path (:class:`RowSampler`).

One object per line (verl / XTuner RL format)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],
     "reward_model": {"ground_truth": "72"},
     "extra_info": {...}}

``prompt`` may also be a plain string (a single user message). ``parquet`` reads verl's parquet
files as they are (the same fields as columns, plus ``ability``) and ``hf_dataset`` a Hugging Face
dataset (a ``save_to_disk`` directory, or data files through ``load_dataset``); their rows are
numbered from 1, like lines (:mod:`rlcli.data.tables`). Every bad row (over
``max_row_bytes``, not UTF-8, not JSON, the wrong shape, an empty prompt, no label: see
:mod:`rlcli.data.rows`) is skipped, located with ``file:line`` and counted (``data/skipped_rows``);
so are rows whose chat template fails. Prompts longer than ``max_prompt_length`` tokens are
dropped too. :meth:`RowSampler.skipped_rows` lists every row left out, with its reason (the
runner writes them to ``skipped_rows.jsonl``); a file with no usable row is refused when the
recipe is validated. The stream is infinite: after the last prompt the next epoch starts with a
fresh permutation seeded by ``seed + epoch``. Position, epoch and the group counter are saved in
checkpoints.
"""

from __future__ import annotations

import contextvars
import logging
import random
from pathlib import Path
from typing import Any, ClassVar, Iterator

from pydantic import Field

from rlcli import hookimpl
from rlcli.component import ComponentConfig
from rlcli.data.base import DataError, Sampler
from rlcli.data.rows import (
    DEFAULT_MAX_ROW_BYTES, Row, SkippedRow, first_usable, no_usable_row_message, parse_records, read_rows, summarize,
)
from rlcli.types import Sample

log = logging.getLogger(__name__)

# Set by rlcli.config.load_recipe so relative data paths can resolve against the recipe's folder.
RECIPE_DIR: contextvars.ContextVar[Path | None] = contextvars.ContextVar("RECIPE_DIR", default=None)


def resolve_data_path(path: str) -> Path:
    """A relative path is tried against the working directory, then the recipe's directory."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    base = RECIPE_DIR.get()
    if base is not None and (base / p).exists():
        return base / p
    return p


class JsonlSamplerConfig(ComponentConfig):
    path: str = Field(..., description="RL JSONL file (relative: to the working dir, else to the recipe's dir).")
    prompt_repeat_k: int = Field(1, ge=1, description="Samples per prompt (the GRPO group size).")
    max_prompt_length: int | None = Field(None, gt=0, description="Drop prompts longer than this (tokens).")
    shuffle: bool = Field(True, description="Shuffle prompts each epoch.")
    seed: int | None = Field(None, description="Shuffle seed; default: the trainer seed.")
    system_prompt: str | None = Field(None, description="Prepended as a system message (replaces an existing one).")
    limit: int | None = Field(None, gt=0, description="Use only the first N valid prompts.")
    max_row_bytes: int | None = Field(
        DEFAULT_MAX_ROW_BYTES, gt=0, description="Skip (and list in skipped_rows.jsonl) a row longer than this "
        "many bytes (default 1 MiB), before it is parsed or tokenized; null: no limit.")
    require_label: bool = Field(
        True, description="Skip a row without reward_model.ground_truth (or a blank one); false for judgers "
        "that need no label.")


class Prompt:
    __slots__ = ("row", "messages", "prompt_ids", "prompt_text", "data_source", "reward_model", "extra_info")

    def __init__(self, row, messages, prompt_ids, prompt_text, data_source, reward_model, extra_info):
        self.row, self.messages, self.prompt_ids, self.prompt_text = row, messages, prompt_ids, prompt_text
        self.data_source, self.reward_model, self.extra_info = data_source, reward_model, extra_info


class RowSampler(Sampler):
    """Prompts from a dataset of RL rows, shuffled per epoch, in groups of prompt_repeat_k; a
    subclass says only how to read the rows (:meth:`read`) and whether the path holds a dataset."""

    Config: ClassVar[type[JsonlSamplerConfig]] = JsonlSamplerConfig

    @classmethod
    def read(cls, path: Path, cfg: JsonlSamplerConfig) -> Iterator[Row | SkippedRow]:
        """Every row at ``path`` in order, usable or skipped (``OSError`` or :class:`DataError` when the
        dataset itself cannot be read)."""
        raise NotImplementedError

    @staticmethod
    def found(path: Path) -> bool:
        return path.is_file()

    @classmethod
    def check_config(cls, cfg: JsonlSamplerConfig) -> list[tuple[str, str]]:
        p = resolve_data_path(cfg.path)
        if not cls.found(p):
            return [("path", f"data file not found: {p}")]
        try:  # cheap: reads only up to the first usable row
            row, skipped = first_usable(cls.read(p, cfg))
        except OSError as exc:
            return [("path", f"cannot read the data file {p}: {exc.strerror or exc}")]
        except DataError as exc:
            return [("path", str(exc))]
        return [] if row is not None else [("path", no_usable_row_message(p, skipped))]

    def __init__(self, config: JsonlSamplerConfig, *, tokenizer, task_name: str, seed: int):
        super().__init__(config)
        self.task_name = task_name
        self.tokenizer = tokenizer
        self.seed = config.seed if config.seed is not None else seed
        self.path = resolve_data_path(config.path)
        self.skipped: list[SkippedRow] = []  # bad rows (data/skipped_rows)
        self.overlong: list[SkippedRow] = []  # prompts over max_prompt_length
        self.prompts = self._load()
        if not self.prompts:
            raise DataError(f"task {task_name!r}: no usable prompt in {self.path}: {len(self.skipped)} bad rows, "
                            f"{len(self.overlong)} over max_prompt_length ({self.config.max_prompt_length}); "
                            + "; ".join(str(s) for s in self.skipped_rows()[:3]))
        self.epoch = 0
        self.position = 0
        self.groups_sampled = 0
        self.rank, self.world = 0, 1
        self._order = self._permutation(0)
        self._pending_skip_report = len(self.skipped)

    # ---------------------------------------------------------------------------------- load
    def _load(self) -> list[Prompt]:
        if not self.found(self.path):
            raise DataError(f"task {self.task_name!r}: data file not found: {self.path}")
        cfg = self.config
        rows: list[Row] = []
        try:
            for r in self.read(self.path, cfg):
                (rows if isinstance(r, Row) else self.skipped).append(r)
        except OSError as exc:
            raise DataError(f"cannot read the data file {self.path}: {exc.strerror or exc}") from None
        n_rows = len(rows) + len(self.skipped)
        texts, templated = [], []
        for r in rows:
            if cfg.system_prompt is not None:
                r.messages[:] = [{"role": "system", "content": cfg.system_prompt}] + [
                    m for m in r.messages if m["role"] != "system"]
            try:
                texts.append(self._template(r.messages))
            except Exception as exc:  # a template that rejects this row's roles or content
                self.skipped.append(SkippedRow(str(self.path), r.line, "template",
                                               f"chat template failed: {type(exc).__name__}: {exc}"))
                continue
            templated.append(r)
        self.skipped.sort(key=lambda s: s.line)
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        from rlcli.tokenizer import warn_unknown_tokens  # torch and transformers: not at import

        warn_unknown_tokens(self.tokenizer, texts, ids, f"task {self.task_name!r}: prompts of {self.path}")
        prompts = []
        limit = cfg.max_prompt_length
        for r, text, pids in zip(templated, texts, ids):
            if limit is not None and len(pids) > limit:
                self.overlong.append(SkippedRow(str(self.path), r.line, "too_long",
                                                f"prompt has {len(pids)} tokens, more than max_prompt_length={limit}"))
                continue
            prompts.append(Prompt(r.line, r.messages, list(pids), text, r.data_source, r.reward_model, r.extra_info))
            if cfg.limit is not None and len(prompts) >= cfg.limit:
                break
        self._log_skipped(n_rows)
        return prompts

    def _log_skipped(self, n_rows: int) -> None:
        for s in self.skipped[:5]:
            log.warning("task %r: skipping row %s", self.task_name, s)
        if self.skipped:
            log.warning("task %r: skipped %d of %d rows of %s (%s)", self.task_name, len(self.skipped), n_rows,
                        self.path, summarize(self.skipped))
        if self.overlong:
            log.warning("task %r: dropped %d prompts longer than max_prompt_length=%d in %s", self.task_name,
                        len(self.overlong), self.config.max_prompt_length, self.path)

    def prompt_lengths(self) -> list[int]:
        return [len(p.prompt_ids) for p in self.prompts]

    def prompt_places(self) -> list[str]:
        """``file:line`` (``file:row`` for a table) of each prompt, in the order of :meth:`prompt_lengths`."""
        return [f"{self.path}:{p.row}" for p in self.prompts]

    def skipped_rows(self) -> list[SkippedRow]:
        """Every row left out, in file order: bad rows and prompts over max_prompt_length."""
        return sorted(self.skipped + self.overlong, key=lambda s: s.line)

    def _template(self, messages: list[dict]) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n".join(m["content"] for m in messages)

    # ------------------------------------------------------------------------------ sampling
    def __len__(self) -> int:
        return len(self.prompts)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.config.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def make_group(self, prompt: Prompt, group_id: int) -> list[Sample]:
        k = self.config.prompt_repeat_k
        label = prompt.reward_model.get("ground_truth")
        return [
            Sample(
                uid=group_id * k + i,
                group_id=group_id,
                task_name=self.task_name,
                prompt_ids=list(prompt.prompt_ids),
                messages=prompt.messages,
                data_source=prompt.data_source,
                label=label,
                reward_model=prompt.reward_model,
                extra_info=prompt.extra_info,
                prompt_text=prompt.prompt_text,
            )
            for i in range(k)
        ]

    def shard(self, rank: int, world: int) -> None:
        """Hand out only every ``world``-th prompt of the shared stream, starting at ``rank``.

        All ranks follow the same per-epoch permutation, so together they cover each epoch once,
        and group ids stay unique across ranks (``index * world + rank``).
        """
        if self.groups_sampled or self.position:
            raise RuntimeError("shard() must be called before sampling")
        self.rank, self.world = rank, world
        self.position = rank

    def sample_group(self) -> list[Sample]:
        """The next prompt of the infinite stream, as ``prompt_repeat_k`` fresh samples."""
        while self.position >= len(self._order):
            self.epoch += 1
            self.position -= len(self._order)
            self._order = self._permutation(self.epoch)
        prompt = self.prompts[self._order[self.position]]
        self.position += self.world
        group = self.make_group(prompt, self.groups_sampled * self.world + self.rank)
        self.groups_sampled += 1
        return group

    def fixed_groups(self, n: int | None = None, shard: tuple[int, int] = (0, 1)) -> list[list[Sample]]:
        """The first ``n`` prompts in file order (all when None): the same set every time (evaluation).

        With ``shard=(rank, world)`` only this rank's part (every ``world``-th prompt); group ids
        are the prompts' indices, whatever the number of ranks.
        """
        chosen = self.prompts if n is None else self.prompts[:n]
        r, w = shard
        return [self.make_group(chosen[i], i) for i in range(r, len(chosen), w)]

    def pop_stats(self) -> dict[str, float]:
        """Rows skipped since the last call (reported once)."""
        n, self._pending_skip_report = self._pending_skip_report, 0
        return {"data/skipped_rows": float(n)} if n else {}

    # ---------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "groups_sampled": self.groups_sampled,
                "num_prompts": len(self.prompts), "seed": self.seed, "rank": self.rank, "world": self.world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_prompts") != len(self.prompts):
            raise ValueError(f"{self.path}: checkpoint was made with {state.get('num_prompts')} prompts, "
                             f"the file now has {len(self.prompts)}; refusing to resume on different data")
        if (state.get("rank", 0), state.get("world", 1)) != (self.rank, self.world):
            raise ValueError(f"{self.path}: checkpoint was made by rank {state.get('rank', 0)} of {state.get('world', 1)}, "
                             f"this is rank {self.rank} of {self.world}; resume with the same number of ranks")
        self.epoch, self.position, self.groups_sampled = state["epoch"], state["position"], state["groups_sampled"]
        self._order = self._permutation(self.epoch)


class JsonlSampler(RowSampler):
    """Prompts from an RL JSONL file, shuffled per epoch, in groups of prompt_repeat_k."""

    name: ClassVar[str] = "jsonl"
    Config: ClassVar[type[JsonlSamplerConfig]] = JsonlSamplerConfig

    @classmethod
    def read(cls, path: Path, cfg: JsonlSamplerConfig) -> Iterator[Row | SkippedRow]:
        return read_rows(path, max_row_bytes=cfg.max_row_bytes, require_label=cfg.require_label)


class ParquetSamplerConfig(JsonlSamplerConfig):
    path: str = Field(..., description="verl-format parquet file (data_source, prompt, ability, reward_model, "
                      "extra_info columns; relative: to the working dir, else to the recipe's dir).")


class ParquetSampler(RowSampler):
    """Prompts from a verl-format parquet file (pyarrow: ``pip install 'rlcli[data]'``), as ``jsonl``."""

    name: ClassVar[str] = "parquet"
    Config: ClassVar[type[ParquetSamplerConfig]] = ParquetSamplerConfig

    @classmethod
    def read(cls, path: Path, cfg: JsonlSamplerConfig) -> Iterator[Row | SkippedRow]:
        from rlcli.data.tables import parquet_records

        return parse_records(parquet_records(path), str(path), max_row_bytes=cfg.max_row_bytes,
                             require_label=cfg.require_label)


class HfDatasetSamplerConfig(JsonlSamplerConfig):
    path: str = Field(..., description="A Hugging Face dataset: a save_to_disk directory (load_from_disk), a "
                      "directory of data files or one data file (load_dataset), with verl's columns.")
    split: str = Field("train", description="The split to read (a DatasetDict's key, or the data files' split).")


class HfDatasetSampler(RowSampler):
    """Prompts from a Hugging Face dataset (``pip install 'rlcli[data]'``), as ``jsonl``."""

    name: ClassVar[str] = "hf_dataset"
    Config: ClassVar[type[HfDatasetSamplerConfig]] = HfDatasetSamplerConfig

    @staticmethod
    def found(path: Path) -> bool:
        return path.exists()

    @classmethod
    def read(cls, path: Path, cfg: HfDatasetSamplerConfig) -> Iterator[Row | SkippedRow]:
        from rlcli.data.tables import hf_dataset_records

        return parse_records(hf_dataset_records(path, cfg.split), str(path), max_row_bytes=cfg.max_row_bytes,
                             require_label=cfg.require_label)


@hookimpl
def register_samplers():
    return [JsonlSampler, ParquetSampler, HfDatasetSampler]
