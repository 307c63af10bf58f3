"""benchmarks/engine_kernels.py: kernel classes, the per-step summary of a hand-made trace, the
merged table of several results files, and the profiled round on this machine's CPU."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import engine_kernels as ek  # noqa: E402


def _trace(tmp_path: Path) -> Path:
    def ev(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": 5000.0 + ts, "dur": dur}

    events = [
        ev("kernel", "nvjet_sm90_tst_128x64_h_bz_TNT", 0, 400),
        ev("kernel", "flash_fwd_splitkv_kernel", 300, 200),  # overlaps (another stream): 100 us new
        ev("kernel", "BatchDecodeWithPagedKVCacheKernel", 600, 100),  # after a 100 us gap
        ev("kernel", "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 700, 50),
        ev("kernel", "rmsnorm_kernel", 750, 50),
        ev("kernel", "void at::native::vectorized_elementwise_kernel<4, ...>", 800, 25),
        ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 825, 75),
        ev("kernel", "top_k_top_p_sampling_from_probs", 900, 100),
        ev("kernel", "some_unknown_kernel", 1000, 100),
        ev("cpu_op", "aten::mm", 0, 5000),  # host work: not GPU activity
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 5.0},  # not a complete event
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_kernel_classes_of_the_engines_names():
    cases = {
        "nvjet_sm90_tst_128x64": "matmul", "sm90_xmma_gemm_bf16bf16": "matmul", "cutlass_80_wmma": "matmul",
        "flash_fwd_splitkv_kernel": "attention", "BatchDecodeWithPagedKVCacheKernel": "attention",
        "_fwd_grouped_split_kernel": "attention",  # LMDeploy's Triton paged attention
        "reshape_and_cache_flash_kernel": "kv-cache write", "fill_kv_cache_kernel": "kv-cache write",
        "triton_per_fused_rms_norm_0": "torch.compile fused",  # compiled, although it names a norm
        "top_k_top_p_sampling_from_probs": "sampling and logprobs", "softmax_warp_forward": "sampling and logprobs",
        "rmsnorm_kernel": "norm", "rotary_embedding_kernel": "rotary", "act_and_mul_kernel": "activation",
        "void at::native::vectorized_elementwise_kernel<4>": "eager elementwise and reductions",
        "Memcpy HtoD (Pageable -> Device)": "copy and memset", "Memset (Device)": "copy and memset",
        "mystery": "other",
    }
    assert {n: ek.kernel_class(n) for n in cases} == cases


def test_summary_is_per_decode_step_of_the_rows(tmp_path):
    events = ek.load_gpu_events(_trace(tmp_path))
    assert len(events) == 9  # the host op and the instant event are left out
    # 40 tokens of 4 rows: 10 decode steps, each figure is the round's total / 10
    s = ek.summarise(events, tokens=40, rows=4, wall_s=0.02, top=3)
    assert s["steps"] == 10
    assert s["span_ms"] == pytest.approx(0.11)  # 0 .. 1100 us
    assert s["busy_ms"] == pytest.approx(0.10)  # 1100 - the 100 us gap
    assert s["idle_ms"] == pytest.approx(0.01)
    assert s["wall_ms"] == pytest.approx(2.0)
    assert s["kernels"] == pytest.approx(0.9)
    cls = s["classes_ms"]
    assert cls["matmul"] == pytest.approx(0.04) and cls["attention"] == pytest.approx(0.03)  # both streams count
    assert cls["copy and memset"] == pytest.approx(0.0075) and cls["other"] == pytest.approx(0.01)
    assert list(cls)[0] == "matmul"  # costliest first
    assert [k["name"] for k in s["top_kernels"]] == ["nvjet_sm90_tst_128x64_h_bz_TNT", "flash_fwd_splitkv_kernel",
                                                     "BatchDecodeWithPagedKVCacheKernel"]
    assert s["top_kernels"][0] == {"name": "nvjet_sm90_tst_128x64_h_bz_TNT", "ms": 0.04, "count": 0.1,
                                   "class": "matmul"}


def test_summary_refuses_a_trace_without_gpu_work():
    with pytest.raises(ValueError, match="no GPU activity"):
        ek.summarise([], tokens=10, rows=2)
    with pytest.raises(ValueError, match="must be positive"):
        ek.summarise([{"ts": 0, "dur": 1, "name": "k"}], tokens=0, rows=2)


def test_table_merges_the_results_of_several_calls(tmp_path, capsys):
    s = ek.summarise(ek.load_gpu_events(_trace(tmp_path)), tokens=40, rows=4, wall_s=0.02)

    def results(name: str, version: str, records: list[dict]) -> Path:
        p = tmp_path / name
        p.write_text(json.dumps({"env": {"engine_version": version}, "results": records}))
        return p

    a = results("a.json", "sglang 0.5.17", [
        {"what": "kernel_profile", "engine": "sglang", "path": "bare", "summary": s},
        {"what": "kernel_profile", "engine": "sglang", "path": "plain", "error": "Traceback ..."},
        {"what": "throughput", "engine": "sglang"}])
    b = results("b.json", "rlcli 0.1.0", [{"what": "kernel_profile", "engine": "embedded", "path": "bare",
                                           "summary": {**s, "busy_ms": 0.05}}])
    cols = ek.columns_from_results([a, b])
    assert list(cols) == ["sglang 0.5.17 bare", "rlcli 0.1.0 bare"]
    md = ek.markdown(cols)
    assert md.splitlines()[0] == "| ms per 4-row decode step | sglang 0.5.17 bare | rlcli 0.1.0 bare |"
    other_rows = ek.markdown({"a": s, "b": {**s, "rows": 8}})  # columns of different batches: no row count
    assert other_rows.splitlines()[0] == "| ms per decode step | a | b |"
    assert "| GPU busy | 0.100 | 0.050 |" in md
    assert "| GPU time: matmul | 0.040 | 0.040 |" in md
    assert ek.main([str(a), str(b), "--md", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_text().startswith("| ms per 4-row decode step |")
    assert "`nvjet_sm90_tst_128x64_h_bz_TNT` 0.040 ms" in capsys.readouterr().out
    assert ek.main([str(tmp_path / "missing.json")]) == 2
    assert ek.main(["--trace", str(_trace(tmp_path)), "--tokens", "40", "--rows", "4"]) == 0


def test_profiled_round_on_the_cpu_writes_a_trace_without_gpu_work(tmp_path):
    """The in-process path for real (torch.profiler around a round): on this machine the trace holds
    host work only, which the summary refuses by name."""
    import torch

    def run() -> float:
        x = torch.randn(64, 64)
        for _ in range(3):
            x = x @ x
        return 123.0

    trace, rate = ek.profiled_round("embedded", None, run, tmp_path / "k", "kernels-embedded-bare")
    assert rate == 123.0 and trace.name == "kernels-embedded-bare.trace.json.gz" and trace.stat().st_size > 0
    with pytest.raises(ValueError, match="no GPU activity"):
        ek.summarise(ek.load_gpu_events(trace), tokens=10, rows=2)


def test_sglang_round_starts_and_stops_the_schedulers_profiler(tmp_path, monkeypatch):
    """SGLang's path over a stand-in of its tokenizer manager (the code around SGLang's profiler:
    the request it sends, the order, and the trace file it finds)."""
    import asyncio
    import types
    from dataclasses import dataclass

    @dataclass
    class ProfileReq:  # the fields of SGLang 0.5.17's io_struct.ProfileReq that the script sets
        output_dir: str | None = None
        activities: list | None = None
        with_stack: bool | None = None
        record_shapes: bool | None = None
        profile_id: str | None = None

    mod = types.ModuleType("sglang.srt.managers.io_struct")
    mod.ProfileReq = ProfileReq
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", mod)
    calls = []

    class TM:
        async def start_profile(self, req):
            calls.append(("start", req))

        async def stop_profile(self):
            calls.append(("stop",))
            src = _trace(tmp_path)  # the scheduler writes <profile_id>-TP-0.trace.json.gz
            (Path(calls[0][1].output_dir) / f"{calls[0][1].profile_id}-TP-0.trace.json.gz").write_bytes(src.read_bytes())

    backend = types.SimpleNamespace(_loop=types.SimpleNamespace(call=lambda coro: asyncio.run(coro)), _tm=TM())
    trace, rate = ek.profiled_round("sglang", backend, lambda: calls.append(("round",)) or 7.0, tmp_path / "k", "kb")
    assert [c[0] for c in calls] == ["start", "round", "stop"] and rate == 7.0
    req = calls[0][1]
    assert (req.activities, req.with_stack, req.record_shapes, req.profile_id) == (["GPU"], False, False, "kb")
    assert trace == tmp_path / "k" / "kb-TP-0.trace.json.gz"
    assert len(ek.load_gpu_events(trace)) == 9
    calls.clear()
    TM.stop_profile = lambda self: asyncio.sleep(0)  # a profiler that wrote nothing
    with pytest.raises(FileNotFoundError, match="SGLang wrote no trace named nothing"):
        ek.profiled_round("sglang", backend, lambda: 1.0, tmp_path / "k", "nothing")
