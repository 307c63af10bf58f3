"""What the parts of ``benchmarks/backends.py`` share: the engines and their plugin modules, the
``RESULT`` records of the run, the time budget of the device call, and the options ``main`` sets
(``--checks``, ``--kit-set``, ``--kit-variant``, ``--deadline-s``, ``--host-profile``,
``--kernel-profile``, ``--paths``, ``--rounds``).

``main`` (and the tests) set the options and ``RESULTS`` after import, some by rebinding them: the
other modules read them as ``common.NAME`` when they run, never by ``from backends_common import``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
for _plugin in ("rlcli-vllm", "rlcli-sglang", "rlcli-lmdeploy"):
    sys.path.insert(0, str(REPO / "plugins" / _plugin))

import grpo_step as gs  # noqa: E402  (model, tokenizer, prompts and recipe of the GRPO benchmark)

ENGINES = ("embedded", "vllm", "sglang", "lmdeploy")
PLUGIN_MODULES = {"vllm": "rlcli_vllm", "sglang": "rlcli_sglang", "lmdeploy": "rlcli_lmdeploy"}
K = gs.K  # copies of each prompt
GRPO_STEPS = 3
RESULTS: list[dict] = []
START = time.monotonic()
DEADLINE_S = 540.0
CHECKS: list[str] = []  # --checks: the conformance checks to run; empty: all
KIT_SET: list[str] = []  # --kit-set: KEY=VALUE settings of the kit engines' backend config
RUN_SET: list[str] = []  # --run-set: KEY=VALUE settings of the run section's rollout config (the tuned engine)
KIT_VARIANTS: list[tuple[str, list[str]]] = []  # --kit-variant NAME:KEY=VALUE,...: the copies section's engines
HOST_PROFILE: Path | None = None  # --host-profile: write the engine thread's profiles here
PATHS: list[str] = []  # --paths: the throughput paths to time besides bare; empty: all
ROUNDS: int = 0  # --rounds: timed throughput rounds; 0: backends_throughput.THROUGHPUT_ROUNDS
KERNEL_PROFILE: bool = False  # --kernel-profile: one bare and one plain round under the GPU profiler


def result(**kw) -> dict:
    RESULTS.append(kw)
    print("RESULT " + json.dumps(kw, default=str), flush=True)
    return kw


def time_left() -> float:
    return DEADLINE_S - (time.monotonic() - START)


def engine_version(engine: str) -> str:
    if engine == "embedded":
        import rlcli

        return f"rlcli {rlcli.__version__}"
    import importlib.metadata as md

    try:
        return f"{engine} {md.version(engine)}"
    except md.PackageNotFoundError:
        return f"{engine} (not installed)"


class NotRun(Exception):
    """A plugin check that cannot run here (the reason is the message)."""
