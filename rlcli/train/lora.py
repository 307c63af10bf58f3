"""LoRA on the trainer's model (``model.lora``), with ``peft``: only the adapters train.

:func:`add_adapters` puts a peft LoRA layer around every targeted linear layer of the decoder
layers, in place (the model keeps its Hugging Face class, so FSDP2 wraps it as usual) and freezes
every other parameter: the optimizer gets the adapters only. What leaves the trainer keeps the
base model's names, so nothing downstream knows about peft:

- a weight sync or a merged HF export gets, under ``<layer>.weight``, the merged weight
  ``W + (alpha / r) · B @ A``, computed in float32 from the full tensors into a new tensor (the
  trainer's ``W`` is never written, also when a backend borrows the trainer's parameters);
- a checkpoint holds the adapters and their optimizer state only (the frozen base is read again
  from the model directory), and its ``meta.json`` records the recipe's ``model.lora``
  (:func:`checkpoint_meta`), which a resume must match;
- an HF export is peft's adapter layout (``adapter_config.json``, ``adapter_model.safetensors``),
  loadable with ``PeftModel.from_pretrained`` (:func:`write_adapter`), plus, with
  ``model.lora.export_merged``, the merged model in ``merged/``.

An engine that loads adapters itself (vLLM's LoRA path) could take :meth:`Adapters.export_names`'
tensors instead of merged weights; none does yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlcli.config import Issue, RecipeError
from rlcli.train import weights
from rlcli.train.checkpoint_files import CheckpointError

if TYPE_CHECKING:
    from rlcli.config import LoraConfig
    from rlcli.train.worker import TrainWorker

EXTRA = "pip install 'rlcli[lora]'"
ADAPTER = "default"  # peft's adapter name inside the trainer's model
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def import_peft():
    """``peft``, or an ImportError naming the extra that installs it."""
    try:
        import peft
    except ImportError as exc:
        raise ImportError(f"model.lora needs the peft package: {EXTRA}") from exc
    return peft


@dataclass(frozen=True)
class Adapters:
    """The LoRA layers of a model: how its parameter names map to the base model's, and the merge.
    ``targets``: the short names of the adapted layers, as the adapter's config records them."""

    r: int
    alpha: float
    dropout: float
    targets: list[str]
    layers: list[str]  # module paths of the adapted layers
    scaling: float

    def hf_name(self, name: str) -> str | None:
        """The base model's name of a state-dict entry of the adapted model; None for an adapter tensor."""
        if ".lora_A." in name or ".lora_B." in name:
            return None
        return name.replace(".base_layer.", ".")

    def merges(self) -> dict[str, tuple[str, str]]:
        """``{base weight name: (A name, B name)}`` of every adapted layer (state-dict names)."""
        return {f"{p}.base_layer.weight": (f"{p}.lora_A.{ADAPTER}.weight", f"{p}.lora_B.{ADAPTER}.weight")
                for p in self.layers}

    def export_names(self) -> dict[str, str]:
        """``{state-dict name of an adapter tensor: its name in peft's adapter_model.safetensors}``."""
        out = {}
        for p in self.layers:
            for m in ("lora_A", "lora_B"):
                out[f"{p}.{m}.{ADAPTER}.weight"] = f"base_model.model.{p}.{m}.weight"
        return out


def add_adapters(hf_model: nn.Module, cfg: LoraConfig) -> Adapters:
    """Freeze ``hf_model`` and add LoRA layers (peft, initialised from torch's generator: A random,
    B zero, so the model starts as the base model). Raises :class:`RecipeError` when
    ``model.lora.target_modules`` names no linear layer of the decoder layers."""
    peft = import_peft()
    hf_model.requires_grad_(False)
    pcfg = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
                           target_modules=cfg.target_modules)
    try:
        peft.inject_adapter_in_model(pcfg, hf_model, adapter_name=ADAPTER)
    except ValueError as exc:
        head = hf_model.get_output_embeddings()
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in hf_model.named_modules()
                         if isinstance(m, nn.Linear) and m is not head})
        raise RecipeError([Issue("model.lora.target_modules", f"{cfg.target_modules}: {exc}; the model's linear "
                                 f"layers are {', '.join(linear)}")]) from None
    adapted = {n: m for n, m in hf_model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    # the merge below is that of nn.Linear layers (W is out x in); the head's weight is read directly
    odd = [n for n, m in adapted.items() if not isinstance(m.get_base_layer(), nn.Linear) or m.fan_in_fan_out]
    odd += [where for m, where in ((hf_model.get_output_embeddings(), "the LM head"),
                                   (hf_model.get_input_embeddings(), "the embeddings")) if m in adapted.values()]
    if odd:
        raise RecipeError([Issue("model.lora.target_modules", f"{cfg.target_modules} matches {', '.join(odd)}: "
                                 "only linear layers inside the decoder layers can take an adapter")])
    layers = list(adapted)
    for name, p in hf_model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    targets = sorted({n.rsplit(".", 1)[-1] for n in layers})
    return Adapters(cfg.r, cfg.alpha, cfg.dropout, targets, layers, cfg.alpha / cfg.r)


def checkpoint_meta(cfg: LoraConfig | None) -> dict[str, Any] | None:
    """What a checkpoint's tensors depend on, from the recipe's ``model.lora`` (recorded in its
    meta.json; a resume must match). Every rank can compute it, with or without a model (the
    rollout ranks of a disaggregated run join checkpoints without one)."""
    if cfg is None:
        return None
    return {"r": cfg.r, "alpha": cfg.alpha, "target_modules": cfg.target_modules}


def check_meta(saved: dict[str, Any] | None, expected: dict[str, Any] | None, where: Path) -> str | None:
    """Why a checkpoint written with ``saved`` adapters cannot load into a model with ``expected``
    ones (None: it can). Both None: full fine-tuning on both sides."""
    if saved == expected:
        return None

    def said(m):
        return "no LoRA (full fine-tuning)" if m is None else f"LoRA {json.dumps(m)}"

    return (f"{where}: written with {said(saved)}, but the recipe's model.lora gives {said(expected)}; resume "
            "with the model.lora the checkpoint was trained with")


def write_adapter(out: Path, adapters: Adapters, tensors: dict[str, torch.Tensor], base_model: str) -> None:
    """peft's adapter layout in ``out``: ``adapter_config.json`` (base_model_name_or_path =
    ``base_model``) and ``adapter_model.safetensors`` (``tensors``: peft's names)."""
    from safetensors.torch import save_file

    peft = import_peft()
    cfg = peft.LoraConfig(r=adapters.r, lora_alpha=adapters.alpha, lora_dropout=adapters.dropout, bias="none",
                          target_modules=adapters.targets, task_type="CAUSAL_LM", base_model_name_or_path=base_model)
    cfg.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def adapter_tensors(worker: TrainWorker) -> dict[str, torch.Tensor]:
    """The adapters' full float32 tensors under peft's names, on rank 0 of the worker's group
    (empty elsewhere). Collective."""
    worker.model.reshard()
    named = worker.hf_model.state_dict(keep_vars=True)
    return weights.gather({saved_as: named[name] for name, saved_as in worker.adapters.export_names().items()},
                          torch.float32, worker.rank == 0)


def save_export(worker: TrainWorker, out: Path, tokenizer, dtype: torch.dtype) -> Path:
    """``TrainWorker.save_hf`` with LoRA: the adapter (float32) and the tokenizer in ``out``, and the
    merged model in ``out/merged`` with ``model.lora.export_merged``. Collective."""
    tensors = adapter_tensors(worker)
    merged = worker.full_state_dict(dtype=dtype) if worker.model_cfg.lora.export_merged else None
    base = str(worker.model_dir.resolve())
    return weights.save_hf(out, worker.hf_model, merged, dtype, tied=worker.tied, tokenizer=tokenizer,
                           writer=worker.rank == 0, group=worker.group,
                           adapter=lambda d: write_adapter(d, worker.adapters, tensors, base))


def load_export(worker: TrainWorker, path: Path) -> None:
    """An adapter written by :func:`save_export` into ``worker``'s adapters (``rlcli eval --checkpoint
    hf/step-N``). Read as JSON and safetensors only. Raises :class:`CheckpointError` when the worker
    has no adapters or other ones. Collective."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    a = worker.adapters
    if a is None:
        raise CheckpointError(f"{path} is a LoRA adapter: evaluate it with the model.lora it was trained with "
                              "(or evaluate the merged model, hf/step-N/merged, written with model.lora.export_merged)")
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (OSError, ValueError, SafetensorError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from None
    saved = (cfg.get("r"), cfg.get("lora_alpha"), sorted(cfg.get("target_modules") or []))
    names = {saved_as: f"lm.{name}" for name, saved_as in a.export_names().items()}
    if saved != (a.r, a.alpha, a.targets) or not set(names) <= set(tensors):
        raise CheckpointError(f"{path}: an adapter of r={saved[0]}, alpha={saved[1]} on {saved[2]}, but the "
                              f"recipe's model.lora gives r={a.r}, alpha={a.alpha} on {a.targets}: evaluate it "
                              "with the model.lora it was trained with")
    worker.model.reshard()
    set_model_state_dict(worker.model, {names[k]: tensors[k] for k in names},
                         options=StateDictOptions(full_state_dict=True, strict=False))


def is_adapter_export(path: Path) -> bool:
    """Whether ``path`` holds a readable ``adapter_config.json`` and its weights file."""
    try:
        return bool(json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))) and (path / WEIGHTS_FILE).is_file()
    except (OSError, ValueError):
        return False
