"""The ``jsonl`` sampler: RL JSONL prompts handed out as groups of ``prompt_repeat_k``.

One object per line (verl / XTuner RL format)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],
     "reward_model": {"ground_truth": "72"},
     "extra_info": {...}}

``prompt`` may also be a plain string (a single user message). A malformed row is reported
with ``file:line``, skipped and counted (``data/skipped_rows``); prompts longer than
``max_prompt_length`` tokens are dropped and counted (``data/overlong_prompts``). The stream is
infinite: after the last prompt the next epoch starts with a fresh permutation seeded by
``seed + epoch``. Position, epoch and the group counter are saved in checkpoints.
"""

from __future__ import annotations

import contextvars
import json
import logging
import random
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from rlcli import hookimpl
from rlcli.component import ComponentConfig
from rlcli.data.base import Sampler
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


class Prompt:
    __slots__ = ("row", "messages", "prompt_ids", "prompt_text", "data_source", "reward_model", "extra_info")

    def __init__(self, row, messages, prompt_ids, prompt_text, data_source, reward_model, extra_info):
        self.row, self.messages, self.prompt_ids, self.prompt_text = row, messages, prompt_ids, prompt_text
        self.data_source, self.reward_model, self.extra_info = data_source, reward_model, extra_info


def _parse_row(obj: Any) -> tuple[list[dict], str, dict, dict]:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise ValueError("'prompt' must be a string or a non-empty list of {role, content} messages")
    data_source = obj.get("data_source", "")
    if not isinstance(data_source, str):
        raise ValueError("'data_source' must be a string")
    reward_model = obj.get("reward_model") or {}
    if not isinstance(reward_model, dict):
        raise ValueError("'reward_model' must be an object")
    extra = obj.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise ValueError("'extra_info' must be an object")
    return messages, data_source, reward_model, extra


class JsonlSampler(Sampler):
    """Prompts from an RL JSONL file, shuffled per epoch, in groups of prompt_repeat_k."""

    name: ClassVar[str] = "jsonl"
    Config: ClassVar[type[JsonlSamplerConfig]] = JsonlSamplerConfig

    @classmethod
    def check_config(cls, cfg: JsonlSamplerConfig) -> list[tuple[str, str]]:
        p = resolve_data_path(cfg.path)
        if not p.is_file():
            return [("path", f"data file not found: {p}")]
        return []

    def __init__(self, config: JsonlSamplerConfig, *, tokenizer, task_name: str, seed: int):
        super().__init__(config)
        self.task_name = task_name
        self.tokenizer = tokenizer
        self.seed = config.seed if config.seed is not None else seed
        self.path = resolve_data_path(config.path)
        self.skipped: list[str] = []  # "file:line: reason"
        self.overlong = 0
        self.prompts = self._load()
        if not self.prompts:
            raise ValueError(f"{self.path}: no usable prompts (skipped {len(self.skipped)} malformed rows, "
                             f"{self.overlong} over max_prompt_length)")
        self.epoch = 0
        self.position = 0
        self.groups_sampled = 0
        self.rank, self.world = 0, 1
        self._order = self._permutation(0)
        self._pending_skip_report = len(self.skipped)

    # ---------------------------------------------------------------------------------- load
    def _load(self) -> list[Prompt]:
        if not self.path.is_file():
            raise FileNotFoundError(f"data file not found: {self.path}")
        rows: list[tuple[int, list[dict], str, dict, dict]] = []
        with self.path.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append((lineno, *_parse_row(json.loads(line))))
                except (json.JSONDecodeError, ValueError) as exc:
                    self.skipped.append(f"{self.path}:{lineno}: {exc}")
        for msg in self.skipped[:5]:
            log.warning("skipping malformed row %s", msg)
        if len(self.skipped) > 5:
            log.warning("... and %d more malformed rows in %s", len(self.skipped) - 5, self.path)
        texts = []
        for _, messages, *_ in rows:
            if self.config.system_prompt is not None:
                messages[:] = [{"role": "system", "content": self.config.system_prompt}] + [
                    m for m in messages if m["role"] != "system"
                ]
            texts.append(self._template(messages))
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        prompts = []
        limit = self.config.max_prompt_length
        for (lineno, messages, source, rm, extra), text, pids in zip(rows, texts, ids):
            if limit is not None and len(pids) > limit:
                self.overlong += 1
                continue
            prompts.append(Prompt(lineno, messages, list(pids), text, source, rm, extra))
            if self.config.limit is not None and len(prompts) >= self.config.limit:
                break
        if self.overlong:
            log.warning("%s: dropped %d prompts longer than max_prompt_length=%d", self.path, self.overlong, limit)
        return prompts

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


@hookimpl
def register_samplers():
    return [JsonlSampler]
