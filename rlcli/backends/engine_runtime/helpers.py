"""Pure helpers of the engine runtime (unit-tested without any engine): request validation, stop
ids, the response budget, weight-update checks, finish reasons and request seeds."""

from __future__ import annotations

import numbers
from typing import Any, Iterable

import torch

from rlcli.backends.base import GenerateRequest
from rlcli.backends.engine_runtime.model_info import ModelInfo
from rlcli.backends.seeds import splitmix64
from rlcli.types import SampleParams

_SEED_MASK = 0x7FFFFFFFFFFFFFFF  # engines take seeds as signed 64-bit integers


def stop_ids_for(params: SampleParams, eos_token_ids: Iterable[int]) -> list[int]:
    """Token ids that end a response: the EOS ids (unless ``ignore_eos``) and ``stop_token_ids``,
    deduplicated in order (a dict, not a list scan: a model may list hundreds of EOS ids)."""
    ids = ([] if params.ignore_eos else list(eos_token_ids)) + list(params.stop_token_ids)
    return list(dict.fromkeys(int(t) for t in ids))


def validate_request(request: GenerateRequest, vocab_size: int, max_model_len: int | None) -> str | None:
    """Why ``request`` cannot be served (the ``error`` message), or None."""
    prompt = request.prompt_ids
    if not isinstance(request.params, SampleParams):
        return f"params must be a SampleParams, got {type(request.params).__name__}"
    if len(prompt) == 0:
        return "empty prompt: at least one prompt token is required"
    if max_model_len is not None and len(prompt) >= max_model_len:
        return (
            f"prompt has {len(prompt)} tokens but max_model_len is {max_model_len}; "
            f"the prompt must leave room for at least one generated token"
        )
    if set(map(type, prompt)) == {int} and 0 <= min(prompt) and max(prompt) < vocab_size:
        return None  # the common case, in C-level passes (an ABC check per token costs ~20 us a prompt)
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size]
    if bad:
        return f"prompt token ids out of range [0, {vocab_size}): {bad[:8]}"
    return None


def response_budget(params: SampleParams, prompt_len: int, max_model_len: int | None) -> int:
    """Tokens the response may have: ``max_tokens``, cut to what the context leaves."""
    if max_model_len is None:
        return params.max_tokens
    return max(0, min(params.max_tokens, max_model_len - prompt_len))


def prepare_weight_update(
    named_tensors: Iterable[tuple[str, Any]], info: ModelInfo
) -> list[tuple[str, torch.Tensor]]:
    """Check Hugging Face-named tensors against the model and map tied aliases to one name.

    Raises ``ValueError`` naming every unknown name and every shape mismatch (before anything is
    loaded). A tied alias (``lm_head.weight`` of a model with tied embeddings) becomes its canonical
    name (``model.embed_tokens.weight``) unless the canonical tensor is in the same call, in which
    case the alias is dropped: engines load tied weights under the canonical name only.
    """
    items = list(named_tensors)
    not_tensors = [str(name) for name, t in items if not isinstance(t, torch.Tensor)]
    if not_tensors:
        raise ValueError(f"update_weights: not tensors: {', '.join(not_tensors)}")
    unknown = [name for name, _ in items if name not in info.shapes]
    if unknown:
        sample = ", ".join(sorted(info.shapes)[:3])
        raise ValueError(
            f"update_weights: {len(unknown)} unknown tensor name(s): {', '.join(unknown)} "
            f"(expected Hugging Face state_dict names such as {sample}, ...)"
        )
    bad = [
        f"{name} {tuple(t.shape)} (model has {info.shapes[name]})"
        for name, t in items
        if tuple(t.shape) != info.shapes[name]
    ]
    if bad:
        raise ValueError(f"update_weights: shape mismatch for {', '.join(bad)}")
    present = {name for name, _ in items}
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in items:
        canonical = info.aliases.get(name)
        if canonical is not None:
            if canonical in present:
                continue
            name = canonical
        out.append((name, tensor))
    return out


def normalize_finish(reason: str | None, error: str | None, aborted: bool) -> tuple[str, str | None]:
    """The contract's finish reason for an engine's one.

    "stop" / "length" pass through. "abort" stays "abort" only when the plugin asked for it
    (pause, sleep, shutdown, a cancelled caller); an abort the engine decided on its own (out of
    memory, rejected input) is an "error" with the engine's message.
    """
    if reason in ("stop", "length"):
        return reason, None
    if reason == "abort":
        if aborted:
            return "abort", None
        return "error", error or "the engine aborted the request"
    return "error", error or f"the engine ended the request with finish reason {reason!r}"


class SeedSequence:
    """Seeds for requests that carry none: distinct per run seed and rank, reproducible."""

    def __init__(self, seed: int, rank: int = 0):
        self._base = splitmix64(((int(seed) & 0xFFFFFFFFFFF) << 20) ^ (int(rank) & 0xFFFFF))
        self._n = 0

    def __call__(self, requested: int | None) -> int:
        if requested is not None:
            return int(requested) & _SEED_MASK
        self._n += 1
        return splitmix64(self._base + self._n) & _SEED_MASK
