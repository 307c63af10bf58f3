"""The benchmarks' judger as an rlcli plugin module: reward = response length mod 7 (as the TRL
baseline of ``grpo_step.py``).

``grpo_step.py`` and ``backends.py`` register it in-process; a multi-process run
(``multi_gpu.py``) names it in ``RLCLI_PLUGINS=bench_plugin`` with ``benchmarks/`` on
``PYTHONPATH``, so that every rank registers it.
"""

from __future__ import annotations

from rlcli import hookimpl
from rlcli.judgers.base import Judger


class LengthMod7(Judger):
    """Benchmark reward: response length mod 7 (as the TRL baseline)."""

    name = "bench_len_mod7"

    def judge(self, response, label, sample):
        return float(len(response) % 7)


@hookimpl
def register_judgers():
    return [LengthMod7]
