"""Model facts read from the Hugging Face directory (no weights loaded): :class:`ModelInfo` and
:func:`read_model_info`, the one reader of a served model's ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlcli.backends.engine_runtime.kv_budget import KVShape, kv_shape_from_config


@dataclass(frozen=True)
class ModelInfo:
    """What the backend needs to know about a Hugging Face model to check requests and updates."""

    model_type: str
    vocab_size: int
    max_position_embeddings: int | None
    shapes: dict[str, tuple[int, ...]]  # state_dict name -> shape (tied aliases included)
    aliases: dict[str, str] = field(default_factory=dict)  # tied alias -> canonical name
    kv_shape: KVShape | None = None  # layers, KV heads and head size: what a token costs in a KV cache

    @property
    def tied(self) -> bool:
        return bool(self.aliases)


def read_model_info(model_dir: str | Path) -> ModelInfo:
    """Names and shapes of a model's ``state_dict`` from a meta-device instance of its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    aliases = {alias: names[0] for names in groups.values() for alias in names[1:]}
    max_pos = getattr(text, "max_position_embeddings", None)
    return ModelInfo(
        model_type=str(getattr(cfg, "model_type", "")),
        vocab_size=int(text.vocab_size),
        max_position_embeddings=int(max_pos) if max_pos else None,
        shapes=shapes,
        aliases=aliases,
        kv_shape=_kv_shape(text),
    )


def _kv_shape(text_config: object) -> KVShape | None:
    """The KV shape, or None for a config without the usual layer and head counts."""
    try:
        return kv_shape_from_config(text_config)
    except (TypeError, ValueError, ZeroDivisionError):
        return None
