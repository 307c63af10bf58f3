"""benchmarks/backends.py's engine-specific code, run over the engine plugins' CPU stand-ins.

The throughput paths (through rlcli, seeded, bare, SGLang's one-request-per-call diagnostic) and their
interleaved, rotating rounds with per-round paired ratios; the markdown report (checks, throughput,
kernel profile, engine settings); the ``copies`` diagnostic; and the script's options ``--checks``,
``--host-profile``, ``--kit-set`` and ``--run-set``. The plugins' stand-in engines come from each
plugin's ``tests/fake_<engine>.py``; a test whose plugin is not installed is skipped.
"""

from __future__ import annotations

import importlib
import re

import pytest

from tests.test_engine_plugins import PLUGINS, REPO, _installed


@pytest.fixture
def bench(monkeypatch):
    """benchmarks/backends.py with the tiny workload of its --tiny mode (its run state, ``RESULTS`` and the
    options, is in ``bench.common``: benchmarks/backends_common.py)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import backends
    import grpo_step as gs

    monkeypatch.setitem(gs.SHAPE, "vocab", 50)  # the tiny models below have 53 tokens
    for name, value in (("DEVICE", "cpu"), ("PROMPTS", 3), ("NEW", 6), ("PROMPT_LEN", 5)):
        monkeypatch.setattr(gs, name, value)
    return backends


@pytest.mark.parametrize("engine", sorted(PLUGINS))
def test_benchmark_throughput_paths_run_over_the_fake_engines(engine, bench, tmp_path, monkeypatch):
    if not _installed(engine):
        pytest.skip(f"{PLUGINS[engine]} is not installed")
    from rlcli.models import tiny_model_dir

    monkeypatch.syspath_prepend(str(REPO / "plugins" / PLUGINS[engine] / "tests"))
    fake = importlib.import_module(f"fake_{engine}")
    cls = {"vllm": "FakeVLLMBackend", "sglang": "FakeSGLangBackend", "lmdeploy": "FakeLMDeployBackend"}[engine]
    backend_cls = getattr(fake, cls)
    d = tiny_model_dir(tmp_path / "m", arch="qwen2")
    be = backend_cls(backend_cls.Config(), fake.context(d))
    try:
        prompts = bench.workload()
        assert len(prompts) == 3 and all(len(p) == 5 for p in prompts)
        for seeded in (False, True):
            assert bench.through_rlcli(be, prompts, seeded=seeded) > 0
        assert be._use_seeds is True  # the seeded round left the switch on
        assert bench.bare(engine, be, prompts) > 0
        if engine == "sglang":  # the diagnostic path: one request per call on the bare engine
            assert bench.bare(engine, be, prompts, each=True) > 0
        else:
            with pytest.raises(ValueError, match="SGLang's diagnostic path"):
                bench.bare(engine, be, prompts, each=True)
        import backends_throughput

        monkeypatch.setattr(backends_throughput, "THROUGHPUT_ROUNDS", 2)
        rates = bench.throughput(engine, be, prompts)  # warm-up + 2 interleaved rounds of each path
        paths = ["bare", "plain", "seeded"] + (["bare_each", "batched"] if engine == "sglang" else [])
        assert sorted(rates) == sorted(paths) and all(len(v) == 2 and min(v) > 0 for v in rates.values())
        # --paths plain --rounds 3: the ratio alone, in more rounds, recorded with its quartiles
        monkeypatch.setattr(bench.common, "PATHS", ["plain"])
        monkeypatch.setattr(bench.common, "ROUNDS", 3)
        monkeypatch.setattr(bench.common, "RESULTS", [])
        import backends_run

        backends_run.report_throughput(engine, be, prompts)
        (rec,) = bench.common.RESULTS
        assert sorted(rec["rounds"]) == ["bare", "plain"] and all(len(v) == 3 for v in rec["rounds"].values())
        assert "rlcli_seeded_tok_s" not in rec and len(rec["ratio_paired_quartiles"]) == 3
        assert rec["ratio_paired_median"] == rec["ratio_paired_quartiles"][1]
        monkeypatch.setattr(bench.common, "PATHS", ["nonesuch"])
        with pytest.raises(ValueError, match="has no path"):
            bench.throughput(engine, be, prompts)
    finally:
        be.shutdown()


def test_benchmark_rounds_rotate_the_order_of_the_paths(bench):
    import backends_throughput as bt

    names = ["plain", "seeded", "bare"]
    orders = [bt.round_order(names, i) for i in range(4)]
    assert orders == [names, ["seeded", "bare", "plain"], ["bare", "plain", "seeded"], names]
    # over len(names) rounds each path runs once in each position
    assert all(sorted(o[j] for o in orders[:3]) == sorted(names) for j in range(3))


def test_benchmark_ratio_pairs_each_round_with_its_bare_round(bench):
    # SGLang's rounds of 2026-12-02: the machine sped up in the last round, plain did not
    rates = {"plain": [17955, 17926, 19903], "seeded": [16906, 17966, 25775], "bare": [17358, 19399, 26138]}
    assert round(max(rates["plain"]) / max(rates["bare"]), 2) == 0.76  # best against best
    assert round(bench.paired_ratio(rates, "plain"), 2) == 0.92
    assert round(bench.paired_ratio(rates, "seeded"), 2) == 0.97


def test_benchmark_markdown_reports_what_ran(bench, monkeypatch):
    monkeypatch.setattr(bench.common, "RESULTS", [
        {"what": "check", "check": "greedy_matches_reference", "status": "pass", "detail": ""},
        {"what": "check", "check": "sleep_wake", "status": "FAIL", "detail": "AssertionError: x | y",
         "by_design": "memory_allocated() is blind"},
        {"what": "check", "check": "many_concurrent", "status": "not run", "detail": "time budget"},
        {"what": "throughput", "rlcli_tok_s": 20000, "rlcli_seeded_tok_s": 15000, "bare_tok_s": 21000, "ratio": 0.952},
    ])
    env = {"date": "2026-12-01", "device": "NVIDIA H200", "torch": "2.11.0", "commit": "abc", "engine_version": "vllm 0.26.0"}
    md = bench.markdown("vllm", env)
    assert "| vllm 0.26.0 | 2026-12-01 | NVIDIA H200 | 1/3 pass; FAIL: sleep_wake; not run: many_concurrent | not run |" in md
    assert "| 20,000 | 15,000 | 21,000 | 0.95 |" in md
    bench.common.RESULTS[-1]["ratio_paired_median"] = 0.9
    assert "| 20,000 | 15,000 | 21,000 | 0.95 (per-round median 0.90) |" in bench.markdown("vllm", env)
    bench.common.RESULTS[-1]["ratio_paired_quartiles"] = [0.85, 0.9, 0.97]
    del bench.common.RESULTS[-1]["rlcli_seeded_tok_s"]  # --paths plain
    assert "| 20,000 | not run | 21,000 | 0.95 (per-round median 0.90, quartiles 0.85, 0.90, 0.97) |" in \
        bench.markdown("vllm", env)
    assert "| sleep_wake | FAIL | AssertionError: x / y | memory_allocated() is blind |" in md


def test_benchmark_markdown_states_the_kernel_profile(bench, monkeypatch):
    summary = {"rows": 512, "wall_ms": 3.0, "span_ms": 2.9, "busy_ms": 2.5, "idle_ms": 0.4, "kernels": 310.0,
               "classes_ms": {"matmul": 1.2, "attention": 0.6}, "top_kernels": []}
    monkeypatch.setattr(bench.common, "RESULTS", [
        {"what": "kernel_profile", "engine": "sglang", "path": "bare", "summary": summary},
        {"what": "kernel_profile", "engine": "sglang", "path": "plain", "error": "Traceback\nValueError: no GPU activity"},
    ])
    env = {"date": "2026-12-05", "device": "NVIDIA H200", "torch": "2.11.0", "commit": "abc", "engine_version": "sglang 0.5.17"}
    md = bench.markdown("sglang", env)
    assert "| ms per 512-row decode step | bare |" in md and "| GPU busy | 2.500 |" in md
    assert "| GPU time: attention | 0.600 |" in md
    assert "Kernel profile of plain: error: ValueError: no GPU activity" in md


def test_benchmark_copies_diagnostic(bench, tmp_path, monkeypatch):
    """``--sections copies``: variants parse, the summary counts parting copies, and the section runs
    each variant's engine through the three loads and reports them in the markdown."""
    assert bench.parse_variant("base:") == ("base", [])
    assert bench.parse_variant("nr:engine_kwargs.disable_radix_cache=true, batch_requests=true") == (
        "nr", ["engine_kwargs.disable_radix_cache=true", "batch_requests=true"])
    for bad in ("noname", ":a=1", "x:a"):
        with pytest.raises(ValueError, match="--kit-variant"):
            bench.parse_variant(bad)
    s = bench.copies_summary([[1], [2], [3]], {(1,): [[5, 6, 7]] * 3, (2,): [[5, 6, 7], [5, 6, 8], [5, 9, 7]],
                                               (3,): [[4, 4], [4, 4, 4]]})
    assert (s["prompts"], s["diverging"], s["most_distinct"], s["earliest_divergence"]) == (3, 2, 3, 1)
    assert s["example"] == {"prompt": [2], "a": [5, 6, 7], "b": [5, 6, 8]}

    monkeypatch.setattr(bench.common, "RESULTS", [])
    monkeypatch.setattr(bench.common, "KIT_VARIANTS", [("base", []), ("mb4", ["max_batch_size=4"]), ("bad", ["nope=1"])])
    bench.section_copies("embedded", tmp_path)
    got = {r["variant"]: r for r in bench.common.RESULTS if r["what"] == "copies"}
    for name in ("base", "mb4"):  # the embedded engine's copies agree under every load
        assert [got[name][k]["diverging"] for k in ("mixed", "alone", "serial")] == [0, 0, 0], got[name]
        assert got[name]["mixed"]["prompts"] == 10
    assert "nope" in got["bad"]["error"]  # a variant that cannot build is reported, the others ran
    env = {"date": "2026-12-02", "device": "CPU", "torch": "2", "commit": "abc", "engine_version": "rlcli 0.1.0"}
    md = bench.markdown("embedded", env)
    assert "| mb4 | max_batch_size=4 | 0 / 10, 1, None | 0 / 10, 1, None | 0 / 10, 1, None |" in md
    assert "| bad | nope=1 | error: " in md


def test_benchmark_conformance_runs_only_the_checks_named(bench, tmp_path, monkeypatch):
    """``--checks``: a later device call reruns the checks an earlier one had no time for."""
    monkeypatch.setattr(bench.common, "RESULTS", [])
    monkeypatch.setattr(bench.common, "CHECKS", ["min_tokens", "sleep_releases_device_memory"])
    bench.section_conformance("embedded", tmp_path)
    checks = {r["check"]: r["status"] for r in bench.common.RESULTS if r["what"] == "check"}
    assert checks == {"min_tokens": "pass", "sleep_releases_device_memory": "not run"}  # no CUDA here


def test_benchmark_host_profile_over_a_fake_engine(bench, tmp_path, monkeypatch):
    """``--host-profile``: one plain and one bare round, profiled on the engine thread."""
    if not _installed("lmdeploy"):
        pytest.skip("rlcli-lmdeploy is not installed")
    from rlcli.models import tiny_model_dir

    monkeypatch.syspath_prepend(str(REPO / "plugins" / "rlcli-lmdeploy" / "tests"))
    fake = importlib.import_module("fake_lmdeploy")
    be = fake.FakeLMDeployBackend(fake.FakeLMDeployBackend.Config(), fake.context(tiny_model_dir(tmp_path / "m", arch="qwen2")))
    try:
        texts = bench.host_profile("lmdeploy", be, bench.workload(), top=40)
    finally:
        be.shutdown()
    assert sorted(texts) == ["bare", "plain"]
    assert re.match(r"# lmdeploy, plain path: [\d,]+ tok/s under the profiler", texts["plain"])
    assert "_engine_generate" in texts["plain"]  # the plugin's own stream handling, seen on the engine thread
    assert "_engine_generate" not in texts["bare"]
    with pytest.raises(bench.NotRun, match="not an engine plugin"):
        bench.host_profile("embedded", object(), [])


def test_benchmark_kit_set_reaches_the_kit_engines_config(bench, monkeypatch):
    """--kit-set KEY=VALUE lands in the kit engines' backend config, dotted keys into engine_kwargs,
    on top of the script's own settings; a key the config does not know fails by name."""
    import pydantic

    mod = pytest.importorskip("rlcli_sglang")
    seen = {}
    real = mod.SGLangBackend.Config

    def capture(**kw):
        seen.update(kw)
        return real(**kw)

    monkeypatch.setattr(mod.SGLangBackend, "Config", capture)
    monkeypatch.setattr(bench.common, "KIT_SET", ["engine_kwargs.disable_radix_cache=true", "use_request_seeds=true"])
    bench.conformance_setup("sglang", "cpu")
    assert seen["use_request_seeds"] is True
    assert seen["engine_kwargs"] == {"disable_prefill_cuda_graph": True, "cuda_graph_max_bs_decode": 32,
                                     "disable_radix_cache": True}
    monkeypatch.setattr(bench.common, "KIT_SET", ["no_such_setting=1"])
    with pytest.raises(pydantic.ValidationError, match="no_such_setting"):
        bench.conformance_setup("sglang", "cpu")


def test_benchmark_run_set_tunes_the_run_sections_engine(bench, monkeypatch):
    """``--run-set``: the run section's rollout config with the tuned settings on top (dotted keys, YAML values)."""
    import backends_run

    monkeypatch.setattr(bench.common, "RUN_SET", ["engine_kwargs.cuda_graph_max_bs=512", "use_request_seeds=false",
                                                  "mem_fraction_static=0.5"])
    cfg = backends_run.run_rollout_config("sglang", 512)
    assert cfg == {"name": "sglang", "mem_fraction_static": 0.5, "max_model_len": 512, "max_batch_size": 512,
                   "engine_kwargs": {"cuda_graph_max_bs": 512}, "use_request_seeds": False}
    monkeypatch.setattr(bench.common, "RUN_SET", [])
    assert backends_run.run_rollout_config("embedded", 8) == {"name": "embedded", "max_model_len": 512,
                                                              "max_batch_size": 8}


def test_benchmark_states_the_engine_settings_it_ran_with(bench, tmp_path, monkeypatch):
    """The run section records what the engine chose after start-up (concurrency, CUDA-graph sizes,
    KV cache, chunked prefill), a list as its length and largest value, missing settings left out,
    and the markdown states them."""
    import types

    import backends_run

    ns = types.SimpleNamespace
    vllm = ns(_engine=ns(vllm_config=ns(scheduler_config=ns(max_num_seqs=512, max_num_batched_tokens=16384),
                                        cache_config=ns(block_size=16, num_gpu_blocks=11265),
                                        compilation_config=ns(cudagraph_capture_sizes=[1, 2, 4, 8, 512]))))
    assert backends_run.engine_settings("vllm", vllm) == {
        "scheduler_config.max_num_seqs": 512, "scheduler_config.max_num_batched_tokens": 16384,
        "cache_config.block_size": 16, "cache_config.num_gpu_blocks": 11265,
        "compilation_config.cudagraph_capture_sizes": {"count": 5, "max": 512}}
    sglang = ns(_sgl=ns(server_args=ns(max_running_requests=512, cuda_graph_max_bs_decode=512,
                                       disable_cuda_graph=False)))
    assert backends_run.engine_settings("sglang", sglang) == {
        "max_running_requests": 512, "cuda_graph_max_bs_decode": 512, "disable_cuda_graph": False}
    assert backends_run.engine_settings("sglang", ns()) == {}  # not started: nothing, no error
    assert backends_run.engine_settings("embedded", vllm) == {}
    if _installed("lmdeploy"):  # the real plugin over its stand-in engine
        from rlcli.models import tiny_model_dir

        monkeypatch.syspath_prepend(str(REPO / "plugins" / PLUGINS["lmdeploy"] / "tests"))
        fake = importlib.import_module("fake_lmdeploy")
        be = fake.FakeLMDeployBackend(fake.FakeLMDeployBackend.Config(), fake.context(tiny_model_dir(tmp_path / "m")))
        try:
            got = backends_run.engine_settings("lmdeploy", be)
        finally:
            be.shutdown()
        assert got.get("block_size") == 64 and got.get("max_batch_size") is not None, got
    monkeypatch.setattr(bench.common, "RESULTS", [
        {"what": "engine_settings", "engine": "sglang", "settings": {"max_running_requests": 512}}])
    env = {"date": "2026-12-04", "device": "NVIDIA H200", "torch": "2.11.0", "commit": "abc",
           "engine_version": "sglang 0.5.17"}
    assert "Engine settings after start-up: `max_running_requests` 512." in bench.markdown("sglang", env)
