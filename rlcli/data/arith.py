"""The quickstart's toy task: the last digit of ``a + b`` for single digits a, b.

100 problems (every pair), written as RL JSONL. A 2-layer model trained from scratch cannot
guess it (chance is 1 in 10) but learns it with GRPO in a few minutes on a laptop CPU.
"""

from __future__ import annotations

from pathlib import Path

from rlcli.fsutil import write_jsonl


def arith_rows() -> list[dict]:
    rows = []
    for a in range(10):
        for b in range(10):
            rows.append({
                "data_source": "arith",
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "reward_model": {"style": "rule", "ground_truth": str((a + b) % 10)},
                "extra_info": {"a": a, "b": b},
            })
    return rows


def write_arith(out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    return [write_jsonl(out / "arith.jsonl", arith_rows())]
