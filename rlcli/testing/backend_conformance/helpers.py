"""Helpers of the conformance kit: tiny models, contexts, transformers references, prompts and
request plumbing shared by the checks."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from rlcli.backends.base import BackendContext, GenerateOutput, GenerateRequest, InferenceBackend
from rlcli.types import SampleParams

BackendFactory = Callable[[str | Path], InferenceBackend]
"""Builds a fresh backend serving the model in the given directory."""

VALID_FINISH = {"stop", "length"}


def default_context(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    version: int = 0,
) -> BackendContext:
    """A :class:`BackendContext` for ``model_dir`` with EOS/pad ids read from its tokenizer
    and ``generation_config.json``."""
    from rlcli.tokenizer import eos_token_ids, load_tokenizer

    tok = load_tokenizer(model_dir)
    return BackendContext(
        model_dir=str(model_dir),
        device=torch.device(device),
        dtype=dtype,
        eos_token_ids=eos_token_ids(tok, model_dir),
        pad_token_id=tok.pad_token_id,
        seed=seed,
        version=version,
    )


def make_tiny_model_dirs(root: str | Path, arch: str = "qwen2", seed: int = 0, **spec: Any) -> tuple[Path, Path]:
    """Two tiny random models of the same shape (``<root>/<arch>-a``, ``<root>/<arch>-b``).

    The default initialisation of a tiny model yields nearly uniform next-token
    distributions, so greedy decoding just repeats a token. These models are re-initialised
    with larger weights so greedy continuations vary and sometimes reach EOS, which makes the
    checks meaningful. ``spec`` goes to :func:`rlcli.models.tiny_model_dir`.
    """
    from rlcli.models import tiny_model_dir

    root = Path(root)
    dirs = []
    for i, name in enumerate(("a", "b")):
        out = tiny_model_dir(root / f"{arch}-{name}", arch=arch, seed=seed + i, **spec)
        _sharpen_model_dir(out, seed=seed + 1000 + i)
        dirs.append(out)
    return dirs[0], dirs[1]


def _sharpen_model_dir(model_dir: Path, seed: int, gain: float = 3.0, embed_std: float = 0.35) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = embed_std if "embed_tokens" in name else gain / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(str(model_dir))


_REFERENCE_CACHE: dict[tuple[str, float], torch.nn.Module] = {}


def _reference_model(model_dir: str | Path) -> torch.nn.Module:
    """The float32 CPU transformers model of ``model_dir`` (cached while the files are unchanged)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(model_dir)
    stamp = max((f.stat().st_mtime for f in path.iterdir() if f.is_file()), default=0.0)
    key = (str(path.resolve()), stamp)
    model = _REFERENCE_CACHE.get(key)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        model.eval()
        # neutral generation settings: the directory's (repetition penalty, ...) must not apply
        model.generation_config = GenerationConfig()
        _REFERENCE_CACHE.clear()  # keep one model: tests walk several directories
        _REFERENCE_CACHE[key] = model
    return model


@torch.no_grad()
def reference_greedy(model_dir: str | Path, prompt: list[int], max_tokens: int, eos_ids: Iterable[int]) -> list[int]:
    """Greedy continuation of ``prompt`` by ``transformers.generate`` in float32 on CPU."""
    model = _reference_model(model_dir)
    eos = list(eos_ids)
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_tokens,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def reference_logprobs(
    model_dir: str | Path, prompt: list[int], response: list[int], temperature: float
) -> torch.Tensor:
    """Per-position ``log_softmax(logits / T)`` ``[len(response), V]`` of a float32 forward."""
    model = _reference_model(model_dir)
    logits = model(torch.tensor([prompt + response])).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / t, dim=-1)


def _vocab_size(model_dir: str | Path) -> int:
    return int(_reference_model(model_dir).config.vocab_size)


def _random_prompts(model_dir, n: int, rng: random.Random, eos_ids, lengths=(1, 12)) -> list[list[int]]:
    vocab = _vocab_size(model_dir)
    avoid = set(eos_ids)
    low = 3 if vocab > 8 else 0  # skip the usual special ids at the start of the vocabulary
    prompts = []
    for _ in range(n):
        length = rng.randint(*lengths)
        p: list[int] = []
        while len(p) < length:
            t = rng.randrange(low, vocab)
            if t not in avoid:
                p.append(t)
        prompts.append(p)
    return prompts


def _eos(backend: InferenceBackend) -> list[int]:
    return list(backend.ctx.eos_token_ids or [])


async def _gen(backend: InferenceBackend, prompt: list[int], seed: int | None = None, **params: Any) -> GenerateOutput:
    return await backend.generate(GenerateRequest(list(prompt), SampleParams(**params), seed=seed))


def _check_shape(out: GenerateOutput, what: str, max_tokens: int | None = None) -> None:
    n = len(out.token_ids)
    assert len(out.logprobs) == n and len(out.versions) == n, (
        f"{what}: token_ids/logprobs/versions lengths differ: {n}, {len(out.logprobs)}, {len(out.versions)}"
    )
    if max_tokens is not None:
        assert n <= max_tokens, f"{what}: {n} tokens generated but max_tokens={max_tokens}"
    for lp in out.logprobs:
        assert math.isfinite(lp) and lp <= 1e-5, f"{what}: invalid logprob {lp}"


def _expected_finish(tokens: list[int], stop_ids: Iterable[int]) -> str:
    return "stop" if tokens and tokens[-1] in set(stop_ids) else "length"
