"""Rules that hold the recipe against the model and the launch, checked without loading any weights.

The model's shape comes from ``model.from_scratch`` or from ``model.path``'s ``config.json`` (read
as JSON). Checked: attention heads against the hidden size and the key/value heads; every task's
``max_prompt_length`` + ``max_tokens`` against the context (``max_position_embeddings``) and,
for training tasks, against ``train_worker.pack_max_length``; ``rollout.max_model_len`` against
the context; the ranks of a launch against ``train_batch_size``; and every task's share of a
step's groups (a task whose weight rounds to 0 groups would never train). Each message names
the fields and the fix.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from rlcli.config.issues import Issue
from rlcli.config.placement import ROLLOUT_RESOURCES, resolve_placement

if TYPE_CHECKING:
    from rlcli.config.sections import ModelConfig, Recipe

_SHAPE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")


def model_shape(model: ModelConfig) -> tuple[dict[str, int], str] | None:
    """``(shape, where)``: the model's integer shape fields and the dotted field (or file) they come from;
    None when the model directory cannot be read (the other rules report that)."""
    if model.from_scratch is not None:
        fs = model.from_scratch
        shape = {k: getattr(fs, k) for k in _SHAPE_KEYS if k != "head_dim"}
        shape["head_dim"] = fs.hidden_size // fs.num_attention_heads
        return shape, "model.from_scratch"
    if model.path is None:
        return None
    from rlcli.hub import ModelLocationError, locate

    try:
        cfg_path = locate(model.path, download=False) / "config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, ModelLocationError):
        return None
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):  # a multimodal model's language part
        cfg = {**cfg, **cfg["text_config"]}
    if not isinstance(cfg, dict):
        return None
    shape = {k: cfg[k] for k in _SHAPE_KEYS if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool)}
    return shape, str(cfg_path)


def model_context(model: ModelConfig) -> tuple[int | None, str]:
    """The model's ``max_position_embeddings`` (None when unknown) and the field or file it comes from."""
    found = model_shape(model)
    if found is None:
        return None, ""
    shape, where = found
    src = "model.from_scratch.max_position_embeddings" if where == "model.from_scratch" else where
    return shape.get("max_position_embeddings"), src


def _field(where: str, key: str) -> str:
    return f"{where}.{key}" if where == "model.from_scratch" else "model.path"


def _check_heads(shape: dict[str, int], where: str, issues: list[Issue]) -> None:
    hidden, heads, kv = shape.get("hidden_size"), shape.get("num_attention_heads"), shape.get("num_key_value_heads")
    src = "" if where == "model.from_scratch" else f" (in {where})"
    if hidden and heads and (where == "model.from_scratch" or "head_dim" not in shape) and hidden % heads:
        divisors = sorted((d for d in range(1, hidden + 1) if hidden % d == 0), key=lambda d: (abs(d - heads), d))[:3]
        issues.append(Issue(_field(where, "num_attention_heads"), f"num_attention_heads={heads} does not divide "
                            f"hidden_size={hidden}{src}: each head gets hidden_size / num_attention_heads "
                            f"dimensions; use a divisor of {hidden} (such as {', '.join(map(str, divisors))})"))
    elif where == "model.from_scratch" and hidden and heads and (hidden // heads) % 2:
        issues.append(Issue(_field(where, "num_attention_heads"), f"hidden_size={hidden} / num_attention_heads="
                            f"{heads} = {hidden // heads} dimensions per head, but rotary position embeddings need "
                            "an even number: change hidden_size or num_attention_heads"))
    if heads and kv and heads % kv:
        fits = [d for d in range(1, heads + 1) if heads % d == 0]
        issues.append(Issue(_field(where, "num_key_value_heads"), f"num_key_value_heads={kv} does not divide "
                            f"num_attention_heads={heads}{src}: grouped-query attention shares each key/value head "
                            f"among an equal number of query heads; use one of {fits}"))


def task_max_tokens(loop_cfg) -> int | None:
    """``sample_params.max_tokens`` of an agent loop's resolved config: the response budget of its
    task (None when the loop has no such field, e.g. a third-party loop with its own config)."""
    max_tokens = getattr(getattr(loop_cfg, "sample_params", None), "max_tokens", None)
    return max_tokens if isinstance(max_tokens, int) else None


def _task_lengths(recipe: Recipe) -> list[tuple[str, bool, int | None, int]]:
    """``(dotted task path, trains, max_prompt_length or None, max_tokens)`` of every resolved task."""
    out = []
    groups = [("tasks", recipe.tasks, True)] + ([("eval.tasks", recipe.eval.tasks, False)] if recipe.eval else [])
    for prefix, tasks, trains in groups:
        for i, t in enumerate(tasks):
            sampler_cfg, loop_cfg = t.sampler._cfg, t.agent_loop._cfg
            max_tokens = task_max_tokens(loop_cfg)
            if sampler_cfg is None or max_tokens is None:
                continue
            mpl = getattr(sampler_cfg, "max_prompt_length", None)
            out.append((f"{prefix}.{i}", trains, mpl if isinstance(mpl, int) else None, max_tokens))
    return out


def _check_lengths(recipe: Recipe, context: int | None, src: str, issues: list[Issue]) -> None:
    pack = recipe.train_worker.pack_max_length
    for where, trains, mpl, max_tokens in _task_lengths(recipe):
        mt_key, mpl_key = f"{where}.agent_loop.sample_params.max_tokens", f"{where}.sampler.max_prompt_length"
        if context is not None and mpl is not None and mpl + max_tokens > context:
            issues.append(Issue(mt_key, f"{mpl_key}={mpl} + {mt_key}={max_tokens} = {mpl + max_tokens} tokens, more "
                                f"than the model's max_position_embeddings={context} ({src}): lower either, so that "
                                "a prompt and its response fit the model"))
        elif context is not None and max_tokens >= context:
            issues.append(Issue(mt_key, f"max_tokens={max_tokens} leaves no room for a prompt in the model's "
                                f"max_position_embeddings={context} ({src}): lower it below {context}"))
        longest = (mpl + max_tokens - 1) if mpl is not None else max_tokens  # input tokens of one sequence
        if trains and longest > pack:
            what = (f"{mpl_key} + max_tokens - 1 = {longest}" if mpl is not None
                    else f"max_tokens={max_tokens} (plus the prompt)")
            issues.append(Issue("train_worker.pack_max_length", f"pack_max_length={pack} is shorter than one "
                                f"sequence of {where}: {what} input tokens; raise it to at least {longest}"))


def _check_rollout_len(recipe: Recipe, context: int | None, src: str, issues: list[Issue]) -> None:
    max_len = getattr(recipe.rollout._cfg, "max_model_len", None)
    if context is not None and isinstance(max_len, int) and max_len > context:
        issues.append(Issue("rollout.max_model_len", f"max_model_len={max_len} is longer than the model's "
                            f"max_position_embeddings={context} ({src}): lower it to at most {context}"))


def allocate_task_batch_sizes(batch_size: int, weights: dict[str, float]) -> dict[str, int]:
    """Largest-remainder split of ``batch_size`` by weight; ties go to the earlier task."""
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    if not weights:
        raise ValueError("at least one task is required")
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("at least one task weight must be positive")
    if batch_size == 0:
        return {t: 0 for t in weights}
    raw = {t: batch_size * w / total for t, w in weights.items()}
    sizes = {t: math.floor(r) for t, r in raw.items()}
    rest = batch_size - sum(sizes.values())
    names = list(weights)
    frac = [raw[n] - sizes[n] for n in names]
    for i in sorted(range(len(names)), key=lambda i: (-frac[i], i))[:rest]:
        sizes[names[i]] += 1
    return sizes


def check_task_shares(recipe: Recipe, batch_sizes: set[int], why: str = "") -> list[Issue]:
    """A task with a positive weight that gets 0 groups of every step for each of ``batch_sizes``
    (the groups one rank produces per step) would never train."""
    weights = {t.task_name: t.weight for t in recipe.tasks}
    if len(weights) < 2 or sum(weights.values()) <= 0 or not batch_sizes or min(batch_sizes) <= 0:
        return []
    starved = set(weights)
    for b in batch_sizes:
        starved &= {name for name, n in allocate_task_batch_sizes(b, weights).items() if n == 0}
    issues = []
    for i, t in enumerate(recipe.tasks):
        if t.task_name in starved and t.weight > 0:
            split = ", ".join(f"{n}: {w:g}" for n, w in weights.items())
            issues.append(Issue(f"tasks.{i}.weight", f"task {t.task_name!r} gets 0 of the {max(batch_sizes)} groups "
                                f"of every step{why} (largest-remainder split by weight: {split}), so it would never "
                                "train: raise its weight or trainer.train_batch_size, or set its weight to 0 to "
                                "leave it out on purpose"))
    return issues


def check_fit(recipe: Recipe) -> list[Issue]:
    """The model's shape, the tasks' lengths and shares (on one rank), as issues."""
    issues: list[Issue] = []
    found = model_shape(recipe.model)
    if found is not None:
        _check_heads(*found, issues)
    context, src = model_context(recipe.model)
    _check_lengths(recipe, context, src, issues)
    _check_rollout_len(recipe, context, src, issues)
    ranks, why = 1, ""
    if recipe.trainer.mode == "disaggregated":
        rollout = resolve_placement(recipe.resources, None)[1]
        ranks, why = len(rollout), f" on each of the {len(rollout)} ranks of {ROLLOUT_RESOURCES}"
    if ranks:
        issues += check_task_shares(recipe, rank_batch_sizes(recipe.trainer.train_batch_size, ranks), why)
    return issues


def rank_batch_sizes(total: int, ranks: int) -> set[int]:
    """The groups per step of the ranks among ``ranks`` that get any of ``total`` (they differ by at most one)."""
    return {n for n in (total // ranks, -(-total // ranks)) if n > 0}


def check_prompt_lengths(task: str, lengths: list[int], max_tokens: int, context: int | None, src: str,
                         pack: int | None, places: list[str] | None = None) -> tuple[list[str], list[str]]:
    """``(errors, warnings)`` for the prompts of ``task``, ``lengths`` tokens each: prompts that leave
    no room for a response in the model's ``context`` (all of them: an error; the first few named
    by their ``places``, ``file:line`` of each prompt, when given) and, for a training task
    (``pack`` given), the longest sequence it can produce against ``pack_max_length``."""
    errors, warnings = [], []
    fits = [n for n in lengths if context is None or n < context]
    if context is not None and len(fits) < len(lengths):
        msg = (f"task {task!r}: {len(lengths) - len(fits)} of {len(lengths)} prompts have {context} tokens or more, "
               f"leaving no room for a response in the model's max_position_embeddings={context} ({src})")
        if places is not None and len(places) == len(lengths):
            over = [f"{where} ({n} tokens)" for where, n in zip(places, lengths) if n >= context]
            msg += f"; the first: {', '.join(over[:3])}"
        if not fits:
            errors.append(f"{msg}: raise max_position_embeddings, or shorten the prompts")
        else:
            warnings.append(f"{msg}; their samples will fail: set the sampler's max_prompt_length (say "
                            f"{max(1, context - max_tokens)}) to drop them")
    if pack is not None and fits:
        longest = max(fits) + max_tokens - 1  # input tokens of a full-length response to the longest prompt
        longest = min(longest, context - 1) if context is not None else longest
        if longest > pack:
            errors.append(f"task {task!r}: its longest prompt ({max(fits)} tokens) with a response of max_tokens="
                          f"{max_tokens} is a sequence of {longest} input tokens, more than train_worker."
                          f"pack_max_length={pack}: raise pack_max_length to at least {longest}, or drop long "
                          "prompts with the sampler's max_prompt_length")
    return errors, warnings
