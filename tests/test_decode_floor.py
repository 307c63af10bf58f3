"""benchmarks/decode_floor.py on the CPU with its tiny model: the script runs end to end and reports
every point of its grid (it measures nothing here; the figures come from a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_floor.py"


def test_tiny_grid_reports_each_point(tmp_path):
    # a process of its own: the script sets grpo_step's module-level work (shape, device, dtype)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path), "--profile",
                           str(tmp_path / "prof")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "decode-floor.json").read_text())
    assert [(r["rows"], r["context"]) for r in rows] == [(1, 8), (4, 8), (1, 16), (4, 16)]
    for r in rows:
        assert r["what"] == "decode_floor" and r["decode_steps"] > 0 and r["ms_per_step"] > 0
        assert r["weight_gb_per_s"] > 0
    assert "decode-floor-" in (tmp_path / "prof" / "profiles.txt").read_text()
