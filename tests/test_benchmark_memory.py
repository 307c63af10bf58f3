"""Helpers of benchmarks/grpo_step.py that run without a GPU: the --memory summaries, the per-step records."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import grpo_step as gs  # noqa: E402


def test_memory_summary_groups_live_blocks_by_allocation_stack():
    def frame(f, line, name):
        return {"filename": f, "line": line, "name": name}

    snap = {"segments": [{"blocks": [
        {"size": 3 * 2**30, "state": "active_allocated", "frames": [frame("/x/site-packages/torch/cuda/memory.py", 1, "f"),
                                                                  frame("/r/rlcli/train/worker.py", 10, "train_step")]},
        {"size": 2**30, "state": "active_allocated", "frames": [  # C++ frames first, as torch records them
            frame("??", 0, "torch::unwind::unwind()"), frame("CUDACachingAllocator.cpp", 0, "malloc"),
            frame("/r/rlcli/train/worker.py", 10, "train_step")]},
        {"size": 5 * 2**30, "state": "inactive", "frames": []},
        {"size": 2**29, "state": "active_allocated", "frames": []},
    ]}]}
    text = gs.summarize_snapshot(snap)
    lines = text.splitlines()
    assert lines[0] == "live: 4.50 GiB in 3 blocks"  # the inactive (cached, free) block is not live
    assert lines[1].split() == ["4.000", "GiB", "2", "blocks", "worker.py:10", "train_step"]  # torch and C++ frames skipped
    assert "(no stack recorded)" in lines[2]


def test_memory_peak_is_replayed_from_the_allocation_trace():
    def ev(action, addr, size, t, name="f"):
        return {"action": action, "addr": addr, "size": size, "time_us": t,
                "frames": [{"filename": "/r/rlcli/train/worker.py", "line": 1, "name": name}]}

    g = 2**30
    trace = [ev("alloc", 1, 2 * g, 0, "weights"),  # before the window, still live at its peak
             ev("alloc", 2, 8 * g, 1, "old"), ev("free_requested", 2, 8 * g, 2),  # a higher peak, outside
             ev("alloc", 3, 3 * g, 10, "activations"), ev("alloc", 4, 1 * g, 11, "logits"),
             ev("free_requested", 4, g, 12), ev("free_completed", 4, g, 12), ev("free_requested", 3, 3 * g, 13)]
    text = gs.peak_in_trace({"device_traces": [trace]}, start_us=10, end_us=20)
    lines = text.splitlines()
    assert lines[0] == "peak in the window (trace event 4 of 8): 6.00 GiB in 3 blocks"
    assert [line.split()[-1] for line in lines[1:]] == ["activations", "weights", "logits"]
    # event times on another clock than the window: the whole trace's peak, said so
    assert "whole trace" in gs.peak_in_trace({"device_traces": [trace]}, start_us=1e15, end_us=2e15).splitlines()[0]


def test_per_step_records_the_engine_and_the_resumed_partial_responses():
    base = {"timing/step_s": 2.0, "timing/rollout_s": 1.0, "timing/train_s": 0.9, "timing/sync_s": 0.01}
    rows = [dict(base), dict(base, **{"engine/busy_s": 0.8, "engine/steps": 600.0, "engine/cuda_graph_captures": 13.0,
                                     "engine/generated_tokens": 1.5e5, "engine/prefill_tokens": 4e4,
                                     "rollout/partial_resumed_samples": 90.0, "rollout/rerolled_samples": 0.0})]
    first, second = gs.per_step(rows, rows[1:])
    assert first == {"step": 1, "step_s": 2.0, "rollout_s": 1.0, "train_s": 0.9, "sync_s": 0.01, "measured": False}
    assert second["measured"] and second["cuda_graph_captures"] == 13.0 and second["prefill_tokens"] == 4e4
    assert second["generated_tokens"] == 1.5e5 and second["partial_resumed_samples"] == 90.0
    assert second["rerolled_samples"] == 0.0
