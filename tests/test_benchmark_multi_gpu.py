"""benchmarks/multi_gpu.py on the CPU (gloo ranks, tiny model): every run of the script, including
the two-"node" launch on one host (``--nnodes 2 --node-rank R``), and RLCLI_PLUGINS reaching every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_multi_gpu_script_runs_every_section_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("RLCLI_PLUGINS", None)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "multi_gpu.py"), "--tiny", "--gpus", "2",
                           "--steps", "2", "--deadline-s", "300", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    runs = {r["label"]: r for r in results if r["what"] == "run"}
    assert sorted(runs) == ["async-colocate-2gpu", "async-disaggregated-2gpu", "nodes-2x1gpu",
                            "scale-tiny-1gpu", "scale-tiny-2gpu"]
    for label, r in runs.items():
        assert "error" not in r, (label, r["error"])
        assert r["steps"] == 2 and r["step_s"] > 0, (label, r)
    dis = runs["async-disaggregated-2gpu"]
    assert dis["staleness_max"] <= 1 and dis["trainer_idle_s"] is not None and dis["sync_s_per_gb"] > 0
    assert runs["async-colocate-2gpu"]["staleness_max"] == 0
    kinds = {r["what"] for r in results}
    assert {"scaling", "async_speedup"} <= kinds
    table = (tmp_path / "table.md").read_text()
    assert "| nodes-2x1gpu | 2 |" in table and "Disaggregated async vs colocated sync on 2 GPUs" in table
