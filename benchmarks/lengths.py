"""Response lengths of the benchmark work: full length (EOS ignored) or a long tail with EOS on.

``full``: every response has exactly ``NEW`` tokens (``ignore_eos``, ``min_tokens = max_tokens``).

``longtail``: EOS is on and responses end where the random-init model samples an end token. The
model is left as it is; its ``generation_config.json`` lists ``K ≈ V / mean`` token ids as
``eos_token_id``. A random-init model's next-token distribution is close to uniform over the
vocabulary (measured on the 0.5B shape in bf16: the mean probability mass on 594 such ids was
1.009 / 256, 3 % spread over positions), so each generated token ends the response with
probability ``p = K / V``: the lengths are geometric with mean ``1 / p``, cut at ``max_new``
(``truncated_geometric_mean``). Every framework of the benchmark reads that list as its own stop
set: rlcli (``rlcli.tokenizer.eos_token_ids``), TRL (``model.generation_config.eos_token_id``),
vLLM (``update_from_generation_config``: the ids join ``stop_token_ids``), so all of them get
the same work without any change to an engine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MEAN = 256  # the mean response length of the long tail (the full-length work's length)
MAX_NEW = 1024  # longtail responses are cut here: P(cut) = (1 - p)^1024 = e^-4 = 1.8 %, mean 251.3


def eos_ids(vocab: int, mean: int = MEAN) -> list[int]:
    """The end ids of the long-tailed work: the tokenizer's ``<eos>`` (``vocab - 1``) and the
    ``K - 1`` word ids just below ``<unk>``/``<pad>`` (``vocab - 3``, ``vocab - 2``), where
    ``K = round(vocab / mean)``. The benchmark's prompts may hold such words; only generated
    ones end a response."""
    k = max(1, round(vocab / mean))
    return [vocab - 1] + list(range(vocab - 3 - (k - 1), vocab - 3))


def stop_probability(vocab: int, mean: int = MEAN) -> float:
    """``p = K / V``: the chance that a token drawn uniformly from the vocabulary ends a response."""
    return len(eos_ids(vocab, mean)) / vocab


def truncated_geometric_mean(p: float, max_new: int) -> float:
    """``E[min(G, max_new)]`` for ``G`` geometric on ``1, 2, ...`` with success probability ``p``
    (the end token counts as a generated token): ``(1 - (1 - p)^max_new) / p``."""
    return (1.0 - (1.0 - p) ** max_new) / p


def longtail_model_dir(model_dir: Path, out: Path, vocab: int, pad_id: int) -> Path:
    """A copy of ``model_dir`` (files symlinked, weights not copied) whose
    ``generation_config.json`` ends responses at :func:`eos_ids`."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        link = out / f.name
        if f.name != "generation_config.json" and not link.exists():
            os.symlink(f.resolve(), link)
    gen = {"eos_token_id": eos_ids(vocab), "pad_token_id": pad_id, "bos_token_id": None}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def length_stats(lengths: list[int], max_new: int) -> dict:
    """Mean, quantiles (nearest rank), max and the share cut at ``max_new`` of response lengths."""
    if not lengths:
        return {}
    s = sorted(lengths)

    def q(x: float) -> int:
        return s[min(len(s) - 1, int(x * len(s)))]

    return {"n": len(s), "mean": round(sum(s) / len(s), 1), "p10": q(0.1), "p50": q(0.5), "p90": q(0.9),
            "p99": q(0.99), "max": s[-1], "cut_frac": round(sum(x >= max_new for x in s) / len(s), 4)}
