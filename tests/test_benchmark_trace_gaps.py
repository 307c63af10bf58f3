"""benchmarks/trace_gaps.py on a small hand-made torch.profiler trace."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import trace_gaps as tg  # noqa: E402


def _trace(tmp_path: Path) -> Path:
    def ev(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": 1000.0 + ts, "dur": dur}

    events = [
        ev("user_annotation", "rlcli/rollout", 0, 1000),
        ev("user_annotation", "rlcli/agent/decode", 700, 50),
        ev("user_annotation", "rlcli/agent/decode", 760, 50),
        ev("user_annotation", "rlcli/train", 1000, 1000),
        ev("user_annotation", "rlcli/train/pack", 1000, 300),
        ev("kernel", "nvjet_sm90_tst_64x64", 100, 400),  # rollout work, 100-500
        ev("kernel", "_attn_fwd", 450, 100),  # overlaps the previous one (another stream): 500-550 new
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 560, 10),  # a 10 us gap before it
        ev("gpu_memset", "Memset (Device)", 1050, 50),  # a 480 us gap that began with the host in rlcli/rollout
        ev("kernel", "triton_poi_fused_mul_silu_3", 1200, 300),  # a 100 us gap that began in rlcli/train/pack
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 5.0},  # not a complete event: ignored
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_gaps_busy_time_and_host_ranges(tmp_path):
    r = tg.analyse(tg.load_events(_trace(tmp_path)), min_gap_us=20, window=(0, 0.6))
    assert r["gpu_first_ms"] == 0.1 and r["gpu_span_ms"] == 1.4
    assert r["gpu_busy_ms"] == pytest.approx(0.81)  # 450 + 50 (the overlap counted once) + 10 + 50 + 300 us
    assert r["gpu_idle_ms"] == pytest.approx(0.59)
    # a gap is charged to the innermost host range open when it began
    assert r["largest_gaps"][:2] == [{"at_ms": 0.57, "gap_ms": 0.48, "host_range": "rlcli/rollout"},
                                     {"at_ms": 1.1, "gap_ms": 0.1, "host_range": "rlcli/train/pack"}]
    assert r["largest_gaps"][2]["gap_ms"] == 0.01
    assert r["idle_by_range_ms"] == {"rlcli/rollout": 0.48, "rlcli/train/pack": 0.1}  # 10 us < min_gap_us
    decode = next(x for x in r["ranges"] if x["name"] == "rlcli/agent/decode")
    assert decode["count"] == 2 and decode["total_ms"] == 0.1
    classes = {c["class"]: c for c in r["window_classes"]}
    assert set(classes) == {"matmul", "attention", "copy Memcpy HtoD"}  # the memset and silu kernels start after 0.6 ms
    text = tg.report(r)
    assert "host in rlcli/train/pack" in text and "host in rlcli/rollout" in text and "x2" in text


def test_cli_writes_json_and_rejects_traces_without_rlcli_ranges(tmp_path, capsys):
    out = tmp_path / "gaps.json"
    assert tg.main([str(_trace(tmp_path)), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["gpu_busy_ms"] == pytest.approx(0.81)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps([{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 1}]))
    assert tg.main([str(bare)]) == 2
    assert "no rlcli/* profiler ranges" in capsys.readouterr().err
