"""benchmarks/rollout_gaps.py on the CPU: each step's rollout, the engine's busy time and their difference."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_each_step_reports_the_time_outside_the_engine_steps():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rollout_gaps.py"), "--tiny", "--lengths", "full",
                           "--steps", "2", "--prompts", "4", "--new", "12"], capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(r"^\| (\d) \| ([\d.]+) \| ([\d.]+) \| (-?\d+) \| (\d+) \| (\d+) \|$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["1", "2"]
    for _, wall, busy, gap, steps, tokens in rows:
        assert 0 < float(busy) <= float(wall) and int(gap) >= 0
        assert int(tokens) == 4 * 8 * 12  # 4 prompts x 8 responses x 12 tokens
        assert int(steps) >= 11  # 12 tokens: the admitting step samples the first
