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
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--taper", "3", "--out", str(tmp_path),
                           "--profile", str(tmp_path / "prof")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads((tmp_path / "decode-floor.json").read_text())
    rows = [r for r in got if r["what"] == "decode_floor"]
    assert [(r["rows"], r["context"]) for r in rows] == [(1, 8), (4, 8), (1, 16), (4, 16)]
    tapered = [r for r in got if r["what"] == "decode_floor_taper"]  # rows finishing along the way
    assert [(r["rows"], r["context"]) for r in tapered] == [(1, 8), (4, 8), (1, 16), (4, 16)]
    assert all(r["mean_active_rows"] <= r["rows"] for r in tapered)
    for r in rows:
        assert r["what"] == "decode_floor" and r["decode_steps"] > 0 and r["ms_per_step"] > 0
        assert r["weight_gb_per_s"] is not None and r["weight_gb_per_s"] >= 0  # a speed: not checked on a CPU
    assert "decode-floor-" in (tmp_path / "prof" / "profiles.txt").read_text()


def test_tapered_lengths_are_geometric_and_cut():
    sys.path.insert(0, str(SCRIPT.parent))
    import decode_floor

    assert decode_floor.lengths_of(3, 64, None, 0) == [64, 64, 64]
    drawn = decode_floor.lengths_of(20000, 1024, 256.0, 0)
    assert min(drawn) >= 1 and max(drawn) == 1024  # cut at the longest
    mean = sum(drawn) / len(drawn)
    assert 246 < mean < 257  # the truncated geometric mean is 251.3


def test_weight_bytes_count_a_shared_storage_once():
    """A tied head and the fused [q; k; v] views each read one storage: bytes of storages, not of parameters."""
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    import decode_floor

    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    fused = torch.zeros(12, 4)
    q, k = torch.nn.Parameter(fused[:8]), torch.nn.Parameter(fused[8:])  # views of one matrix
    hf = torch.nn.Module()
    hf.emb, hf.head = emb, head
    hf.register_parameter("q", q)
    hf.register_parameter("k", k)
    assert decode_floor.weight_bytes(SimpleNamespace(model=SimpleNamespace(hf=hf))) == (40 + 48) * 4
