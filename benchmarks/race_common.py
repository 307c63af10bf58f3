"""What every run of the learning race (``benchmarks/learning_race.py``) shares, whichever framework runs
it: the GRPO group size, each external engine's share of device memory, and the facts a run records
about its machine."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
KV_SHARE = 0.3  # device memory share of each external engine's KV cache (all engines, both frameworks)
GROUP = 8


def device_facts() -> dict[str, Any]:
    """GPU, date, versions of every package in the comparison (None: not installed), peak memory."""
    import torch

    def version(name: str) -> str | None:
        return next((d.version for d in md.distributions(name=name)), None)

    cuda = torch.cuda.is_available()
    names = ("torch", "transformers", "trl", "vllm", "sglang", "lmdeploy", "accelerate", "datasets")
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=REPO, check=False,
                                capture_output=True, text=True).stdout.strip()
    except OSError:  # no git on the machine
        commit = ""
    return {"gpu": torch.cuda.get_device_name(0) if cuda else "CPU (smoke test)", "date": time.strftime("%Y-%m-%d"),
            "python": sys.version.split()[0], "versions": {n: version(n) for n in names}, "commit": commit or "?",
            "peak_gib_torch": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}
