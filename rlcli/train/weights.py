"""The trained weights out of FSDP2: HF-named buckets for an inference engine, and HF model dirs.

Used through ``TrainWorker.iter_weights``, ``full_state_dict`` and ``save_hf``, which pass
their model, group and rank. Every function here is collective over the worker's group.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from rlcli.dist import barrier
from rlcli.faults import fault_point
from rlcli.fsutil import publish_dir, write_failure

if TYPE_CHECKING:
    from rlcli.train.lora import Adapters

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024

Bucket = list[tuple[str, torch.Tensor]]


def iter_weights(model: nn.Module, hf_model: nn.Module, bucket_bytes: int, dtype: torch.dtype, live: bool,
                 lendable: bool, adapters: Adapters | None = None) -> Iterator[Bucket]:
    """``TrainWorker.iter_weights``: ``hf_model``'s full tensors in buckets (``model``: the FSDP
    root around it, resharded first). ``live`` needs ``lendable`` (one rank). With ``adapters``
    (LoRA), the base model's names and tensors: each adapted layer's weight merged, as a new tensor."""
    if live and not lendable:
        raise ValueError("iter_weights(live=True) needs a single rank (each parameter whole on it)")
    model.reshard()
    named = hf_model.state_dict(keep_vars=True)  # the parameters themselves: no per-tensor detach
    merges = adapters.merges() if adapters is not None else {}
    # Tied weights are one parameter under several names: gather once, yield under each name.
    aliases: dict[int, list[str]] = {}
    for name, p in hf_model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    canonical = {n: names[0] for names in aliases.values() for n in names}
    remaining = {names[0]: len(names) for names in aliases.values()}
    cache: dict[str, torch.Tensor] = {}
    bucket: Bucket = []
    size = 0
    for name, tensor in named.items():
        out_name = adapters.hf_name(name) if adapters is not None else name
        if out_name is None:  # an adapter's own tensor: part of its layer's merged weight
            continue
        src = canonical.get(name, name)
        if src in cache:
            full, nbytes = cache[src], 0
        else:
            with torch.no_grad():  # the state dict holds the parameters themselves (keep_vars)
                if name in merges:
                    a, b = merges[name]
                    full = merged_weight(tensor, named[a], named[b], adapters.scaling, dtype)
                else:
                    full = _lent(tensor) if live else _full(tensor, dtype)
            nbytes = full.numel() * (dtype.itemsize if live and full.is_floating_point() else full.element_size())
        left = remaining.get(src, 1) - 1
        remaining[src] = left
        if left > 0:
            cache[src] = full
        else:
            cache.pop(src, None)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((out_name, full))
        size += nbytes
    if bucket:
        yield bucket


def _lent(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a one-rank parameter, detached, not copied."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    if tuple(local.shape) != tuple(tensor.shape):
        raise RuntimeError(f"parameter of shape {tuple(tensor.shape)} has a local shard of {tuple(local.shape)}")
    return local.detach()


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """A LoRA layer's merged weight ``base + (b @ a) * scaling`` (peft's merge, in its order of
    operations), in float32 from the full tensors, cast to ``dtype``: a new tensor; ``base`` is
    only read."""
    w, a, b = (_whole(t).detach().float() for t in (base, a, b))
    return (w + (b @ a) * scaling).to(dtype)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a parameter (gathered where it is sharded; no copy on one rank)."""
    if not isinstance(tensor, DTensor):
        return tensor
    local = tensor._local_tensor
    # One rank: the local shard is the whole tensor; skip the all-gather (a copy and a collective
    # launch per tensor).
    if tensor.device_mesh.size() == 1 and tuple(local.shape) == tuple(tensor.shape):
        return local
    return tensor.full_tensor()


def _full(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    full = _whole(tensor).detach()
    if full.is_floating_point():
        full = full.to(dtype)
    if full.data_ptr() == local.data_ptr():
        full = full.clone()
    return full


def full_state_dict(buckets: Iterable[Bucket], keep: bool, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``buckets`` on ``device`` where ``keep`` (rank 0 of the group), else ``{}``;
    the buckets are drained either way (every rank takes part in each gather)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        if keep:
            out.update((n, t.to(device)) for n, t in bucket)
    return out


def gather(params: dict[str, torch.Tensor], dtype: torch.dtype, keep: bool) -> dict[str, torch.Tensor]:
    """Full copies of ``params`` (sharded or not), cast to ``dtype``, on the CPU where ``keep`` (rank
    0 of the group), else ``{}``. Collective (every rank gathers every tensor in the same order)."""
    out = {}
    with torch.no_grad():
        for name, p in params.items():
            full = _full(p, dtype)
            if keep:
                out[name] = full.cpu()
    return out


def is_complete_export(path: Path) -> bool:
    """Whether ``path`` is a whole HF export: a readable ``config.json`` and every weights file it needs
    (a LoRA export: a readable ``adapter_config.json`` and the adapter's weights file)."""
    from rlcli.train.lora import is_adapter_export

    if is_adapter_export(path):
        return True
    try:
        if not json.loads((path / "config.json").read_text(encoding="utf-8")):
            return False
        if (path / "model.safetensors").is_file():
            return True
        shards = json.loads((path / "model.safetensors.index.json").read_text(encoding="utf-8"))["weight_map"]
        return all((path / f).is_file() for f in set(shards.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def save_hf(out: Path, hf_model: nn.Module, state: dict[str, torch.Tensor] | None, dtype: torch.dtype, *,
            tied: bool, tokenizer, writer: bool, group: dist.ProcessGroup | None,
            adapter: Callable[[Path], None] | None = None) -> Path:
    """``TrainWorker.save_hf``: ``writer`` (rank 0 of the group, holding the full ``state``) writes
    ``out`` atomically; every rank of ``group`` waits for it. With ``adapter`` (LoRA: writes the
    adapter files into a directory), ``out`` holds the adapter and the tokenizer, and the model of
    ``state`` (the merged weights) goes to ``out/merged`` unless ``state`` is None."""
    if writer:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            if adapter is None:
                _write_model(tmp, hf_model, state, dtype, tied, tokenizer)
            else:
                tmp.mkdir(parents=True)
                adapter(tmp)
                _write_tokenizer(tmp, tokenizer)
                if state is not None:
                    _write_model(tmp / "merged", hf_model, state, dtype, tied, tokenizer)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error on a full disk
            failure = write_failure(tmp, exc)
            if failure is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise failure from None
        fault_point(f"hf_export:before_publish:{out.name}")
        publish_dir(tmp, out)
    barrier(group)
    return out


def _write_model(path: Path, hf_model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype, tied: bool,
                 tokenizer) -> None:
    """An HF model directory at ``path``: ``hf_model``'s config with the weights of ``state``."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(hf_model.config)
    config.use_cache = True
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(state, strict=True, assign=True)
    if tied:
        plain.tie_weights()
    plain.generation_config = copy.deepcopy(hf_model.generation_config)
    # Recent transformers write only on global rank 0 of the job; the writer is rank 0 of this
    # worker's group (not global rank 0 when other ranks do rollout), and it holds the full state.
    plain.should_save_on_this_rank = lambda is_main_process=True: bool(is_main_process)
    plain.save_pretrained(str(path))
    _write_tokenizer(path, tokenizer)


def _write_tokenizer(path: Path, tokenizer) -> None:
    from rlcli.tokenizer import save_tokenizer

    if tokenizer is not None:
        save_tokenizer(tokenizer, path, builtin=getattr(tokenizer, "_rlcli_builtin", None))
