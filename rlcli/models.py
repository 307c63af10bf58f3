"""Model directories: a user's HF model (a directory or a Hub id, :mod:`rlcli.hub`), or a from-scratch model materialised into the work dir.

Every component that needs weights (trainer, inference backend, exporter) reads one Hugging
Face directory, so a from-scratch model is first written to ``<work_dir>/model-init``
(deterministic for a given seed) and then treated like any other model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from rlcli.fsutil import publish_dir
from rlcli.hub import check_no_remote_code, locate
from rlcli.tokenizer import BUILTIN_PREFIX, load_tokenizer, save_tokenizer

_ARCH_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("resources.device is 'cuda' but no CUDA device is available")
    return torch.device(name)


def build_from_scratch(arch: str, spec: dict, tokenizer, seed: int, out_dir: str | Path) -> Path:
    """Write a randomly initialised model plus its tokenizer to ``out_dir`` (atomically)."""
    import transformers
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    cfg_cls = getattr(transformers, _ARCH_CONFIGS[arch])
    spec = {k: v for k, v in spec.items() if k != "arch"}
    vocab = len(tokenizer)
    head_dim = spec["hidden_size"] // spec["num_attention_heads"]
    cfg = cfg_cls(
        vocab_size=vocab,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        head_dim=head_dim,
        **spec,
    )
    devnull_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    torch.random.set_rng_state(devnull_state)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    builtin = getattr(tokenizer, "_rlcli_builtin", None)
    save_tokenizer(tokenizer, tmp, builtin=builtin)
    return publish_dir(tmp, out)


def prepare_model_dir(model_cfg, work_dir: str | Path, seed: int) -> Path:
    """The HF directory of the initial policy for a recipe's ``model`` section."""
    if model_cfg.path is not None:  # a directory or a Hub id (downloaded unless offline)
        return locate(model_cfg.path, field="model.path", need="model")
    out = Path(work_dir) / "model-init"
    if (out / "config.json").exists():
        check_no_remote_code(out, str(out), "model.from_scratch")  # rlcli wrote it; refuse one edited since
        return out
    tok = load_tokenizer(model_cfg.tokenizer)
    if str(model_cfg.tokenizer).startswith(BUILTIN_PREFIX):
        tok._rlcli_builtin = str(model_cfg.tokenizer)
    fs = model_cfg.from_scratch
    return build_from_scratch(fs.arch, fs.model_dump(), tok, seed, out)


def tokenizer_source(model_cfg, model_dir: str | Path) -> str:
    """Where the run's tokenizer comes from: an explicit model.tokenizer or the model dir."""
    if model_cfg.tokenizer and not str(model_cfg.tokenizer).startswith(BUILTIN_PREFIX):
        return str(locate(str(model_cfg.tokenizer), field="model.tokenizer", need="tokenizer"))
    return str(model_dir)


def tiny_model_dir(out_dir: str | Path, arch: str = "llama", seed: int = 0, **spec) -> Path:
    """A tiny random model with the ``builtin:arith`` tokenizer, for tests and examples."""
    from rlcli.config import FromScratch

    fs = FromScratch(arch=arch, **spec)
    tok = load_tokenizer("builtin:arith")
    tok._rlcli_builtin = "builtin:arith"
    return build_from_scratch(arch, fs.model_dump(), tok, seed, out_dir)
