"""benchmarks/plugin_host_overhead.py on the CPU: both paths run a round and the table says when."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_both_paths_report_the_last_send_and_the_time_past_the_answer():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plugin_host_overhead.py"), "--rounds", "1",
                           "--hold-s", "0.3"], capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(r"^\| 1 \| (rlcli|bare_each) \| ([\d.]+) \| (-?[\d.]+) \|$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["rlcli", "bare_each"]
    for _, sent, past in rows:  # every request reached the engine before it answered, and none came back early
        assert 0 < float(sent) < 300 and float(past) >= 0
    assert "leaked" not in proc.stderr  # the heap was thawed: everything is collected at exit
