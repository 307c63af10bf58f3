"""benchmarks/step_sweep.py and benchmarks/lengths.py without a GPU: the plan, the calls, the merged table."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import lengths  # noqa: E402
import step_sweep as sw  # noqa: E402


def test_long_tail_end_ids_and_mean():
    ids = lengths.eos_ids(151936)
    assert len(ids) == round(151936 / 256) == len(set(ids))
    assert 151935 in ids and not {151934, 151933} & set(ids)  # <eos> in, <pad> and <unk> out
    assert lengths.truncated_geometric_mean(1 / 256, 1024) == (1 - (255 / 256) ** 1024) * 256
    assert math.isclose(lengths.truncated_geometric_mean(1 / 256, 1024), 251.3, abs_tol=0.05)
    st = lengths.length_stats([1, 2, 3, 1024], 1024)
    assert (st["mean"], st["p50"], st["max"], st["cut_frac"]) == (257.5, 3, 1024, 0.25)


def test_plan_covers_every_shape_and_length():
    runs = sw.plan_runs()
    ids = [r.id for r in runs]
    assert len(ids) == len(set(ids))
    for shape in sw.SHAPE_ORDER:
        for ln in ("full", "longtail"):
            assert {f"{shape}-{ln}-rlcli", f"{shape}-{ln}-trl-vllm"} <= set(ids)
        assert f"{shape}-longtail-rlcli-async" in ids and f"{shape}-full-rlcli-async" not in ids
    by = {r.id: r for r in runs}
    seven = by["7b-full-rlcli"]  # the 7b preset (bfloat16 moments, smaller packs) wins over HEADLINE
    assert "train_worker.optimizer.moment_dtype=bfloat16" in seven.extra
    assert "train_worker.pack_max_length=32768" in seven.extra and "train_worker.pack_max_length=65536" not in seven.args
    assert "train_worker.pack_max_length=65536" in by["3b-full-rlcli"].args
    assert "model.lora.r=16" in by["0.5b-full-rlcli-lora"].args
    assert "train_worker.kl.ref_offload=true" in by["0.5b-full-rlcli-kl-refoffload"].args
    free = by["0.5b-longtail-rlcli-async-free"]  # the async row without the engine's lockstep
    assert free.extra == sw.ASYNC + ["rollout.lockstep=false"] and free.steps == sw.LONGTAIL_STEPS
    assert [r.id for r in sw.select(runs, "7b-*-trl-vllm")] == ["7b-full-trl-vllm", "7b-longtail-trl-vllm"]
    for engine in sw.ENGINE_PLUGINS:  # the plugin's rollout, everything else as the embedded row
        row = by[f"0.5b-full-rlcli-{engine}"]
        assert row.extra == [f"rollout.name={engine}"]
        assert row.args == ["--rlcli", "--label", f"rlcli-{engine}", "--engine-plugin", engine] + \
            by["0.5b-full-rlcli"].args[3:] + ["--set", f"rollout.name={engine}"]
        bare = by[f"0.5b-full-rlcli-{engine}-nolp"]  # the same, the engine asked for no logprobs
        assert bare.extra == sw.NO_LOGPROBS + [f"rollout.name={engine}"]
        assert sw.engine_of(bare) == engine
        assert [a for a in bare.args if a not in row.args] == [f"rlcli-{engine}-nolp", *sw.NO_LOGPROBS]
    idle = by["0.5b-full-rlcli-sglang-idle"]  # SGLang's scheduler asleep when idle, not spinning
    assert idle.extra == ["rollout.engine_kwargs.sleep_on_idle=true", "rollout.name=sglang"]
    assert not any(r.startswith(("0.5b-full-rlcli-vllm-idle", "0.5b-full-rlcli-lmdeploy-idle")) for r in by)


def test_long_tail_rows_measure_past_the_graph_captures():
    by = {r.id: r for r in sw.plan_runs()}
    for shape in sw.SHAPE_ORDER:  # sync and async over as many steps, past async's new decode shapes
        assert by[f"{shape}-longtail-rlcli"].steps == by[f"{shape}-longtail-rlcli-async"].steps == sw.LONGTAIL_STEPS
        assert sw.LONGTAIL_STEPS > by[f"{shape}-full-rlcli"].steps
    rec = _rec("0.5b-longtail-rlcli-async", 4.0)
    rec["results"][0].update(trainable_params=494e6, per_step=[
        {"cuda_graph_captures": 29.0, "measured": False}, {"cuda_graph_captures": 13.0, "measured": True},
        {"cuda_graph_captures": 0.0, "measured": True}])
    assert "trains 494.0M parameters; CUDA graphs captured in the measured steps: 13 + 0" in sw.table([rec])
    rec["results"][0]["per_step"][1]["cuda_graph_captures"] = 0.0  # none in the measured steps: not said
    assert "captured" not in sw.table([rec])


def test_calls_keep_to_the_budget():
    runs = sw.plan_runs()
    calls = sw.pack_calls(runs, 540)
    assert [r.id for c in calls for r in c] == [r.id for r in runs]
    assert all(len({sw.engine_of(r) for r in c}) == 1 for c in calls)  # one engine's wheels a call
    assert [r.id for c in calls for r in c if sw.engine_of(r) == "vllm"] == \
        ["0.5b-full-rlcli-vllm", "0.5b-full-rlcli-vllm-nolp"]
    assert any(len(c) == 2 and sw.engine_of(c[0]) == "vllm" for c in calls)
    left = {r.id for r in runs} - {r.id for r in sw.cpu_runs(runs)}  # --tiny: no engine plugin on the CPU
    assert left == {f"0.5b-full-rlcli-{e}{w}" for e in sw.ENGINE_PLUGINS for w in ("", "-nolp")} | \
        {"0.5b-full-rlcli-sglang-idle", "0.5b-full-rlcli-sglang-nolp-idle"}
    assert [r.id for c in calls for r in c if sw.engine_of(r) == "sglang"] == \
        ["0.5b-full-rlcli-sglang", "0.5b-full-rlcli-sglang-nolp", "0.5b-full-rlcli-sglang-idle",
         "0.5b-full-rlcli-sglang-nolp-idle"]
    for call in calls:
        est = sum(sw.estimate_s(r, cold=not any(x.shape == r.shape for x in call[:j])) for j, r in enumerate(call))
        assert est <= 540 or len(call) == 1


def _rec(rid, step=None, error=None, what="rlcli"):
    shape, ln = rid.split("-")[:2]
    rec = {"id": rid, "shape": shape, "lengths": ln, "row": rid, "extra": [],
           "env": {"date": "2026-12-05", "gpu": "H200", "torch": "2.11"}}
    if error:
        rec["error"] = error
    else:
        rec["results"] = [{"what": what, "step_s_median": step, "step_s_min": step, "step_s_max": step,
                           "rollout_s": 1, "train_s": 1, "sync_s": 0, "gen_tok_per_s": 5, "train_mfu": 0.3,
                           "peak_gib": 9, "response_lengths": lengths.length_stats([10, 20], 1024)}]
    return rec


def test_merge_keeps_results_and_the_table_states_ratios(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    sw.write(a, [_rec("0.5b-full-rlcli", 2.0), _rec("0.5b-longtail-rlcli", 6.0)])
    sw.write(b, [_rec("0.5b-full-rlcli", error="Traceback\nOutOfMemoryError: x"),  # a failed retry keeps the result
                 _rec("0.5b-full-trl-vllm", 10.0, what="trl-vllm"), _rec("0.5b-longtail-rlcli-async", 4.0),
                 _rec("7b-full-rlcli", error="Traceback\nValueError: boom")])
    recs = sw.merge([a, b / "sweep-results.json"])
    assert [r["id"] for r in recs] == ["0.5b-full-rlcli", "0.5b-full-trl-vllm", "0.5b-longtail-rlcli",
                                       "0.5b-longtail-rlcli-async", "7b-full-rlcli"]
    text = sw.table(recs)
    assert "rlcli 2.0 s, TRL + vLLM tuned 10.0 s: **5.00×**" in text
    assert "async 4.0 s against sync 6.0 s: **1.50×**" in text
    assert "ValueError: boom" in text and "2026-12-05" in text
    text = sw.table(recs + [_rec("0.5b-full-rlcli-sglang", 3.0)])
    assert "the sglang plugin 3.0 s against the embedded engine 2.0 s: **1.50×** the embedded step" in text
    text = sw.table(recs + [_rec("0.5b-full-rlcli-vllm-nolp", 2.5)])
    assert "the vllm plugin, no logprobs 2.5 s against the embedded engine 2.0 s: **1.25×**" in text
    text = sw.table(recs + [_rec("0.5b-full-rlcli-sglang-idle", 2.8)])
    assert "the sglang plugin, sleep_on_idle 2.8 s against the embedded engine 2.0 s: **1.40×**" in text
    assert json.loads((b / "sweep-results.json").read_text())["runs"][0]["id"] == "0.5b-full-rlcli"


def test_tuned_trl_vllm_row_states_its_settings():
    import grpo_trl

    work = dict(prompts=64, k=8, new=256, prompt_len=64, device="cpu", lengths="full")
    kw = grpo_trl.trl_config_kwargs(work, 3, grpo_trl.tuned_settings("0.5b"))
    # the tuned row: TRL_VLLM with sleep mode and the importance-sampling pass off, full lengths forced
    assert (kw["use_vllm"], kw["vllm_mode"], kw["vllm_gpu_memory_utilization"]) == (True, "colocate", 0.3)
    assert kw["vllm_enable_sleep_mode"] is False and kw["vllm_importance_sampling_correction"] is False
    assert kw["generation_kwargs"] == {"ignore_eos": True} and kw["vllm_max_model_length"] == 320
    big = grpo_trl.tuned_settings("7b")  # the engine makes room to train, activations are recomputed
    assert big["vllm_enable_sleep_mode"] is True and big["gradient_checkpointing"] is True
    assert grpo_trl.tuned_settings("3b")["gradient_checkpointing"] is True and "gradient_checkpointing" not in \
        grpo_trl.tuned_settings("1.5b")
    assert grpo_trl.tuned_settings("0.5b", "longtail")["gradient_checkpointing"] is True  # 1,024-token responses
    assert "generation_kwargs" not in grpo_trl.trl_config_kwargs(dict(work, lengths="longtail"), 3, {})
    rows = {r.id: r for r in sw.plan_runs()}
    assert rows["0.5b-full-trl-vllm"].args == ["--trl-vllm-tuned"]
    assert rows["0.5b-full-trl-vllm-default"].args == ["--trl-vllm"] and "7b-full-trl-vllm-default" not in rows


def test_host_peak_covers_the_stretch_since_its_reset():
    import host_memory

    if not host_memory.reset_peak() or host_memory.peak_gib() is None:
        import pytest

        pytest.skip("this kernel keeps no resettable VmHWM in /proc")
    base = host_memory.peak_gib()
    block = b"x" * (300 * 2**20)  # written, so resident
    high = host_memory.peak_gib()
    assert high >= base + 0.25
    del block
    assert host_memory.reset_peak() and host_memory.peak_gib() <= high - 0.25  # freed, and the mark starts again


def test_a_killed_run_says_so(monkeypatch):
    import signal
    import subprocess

    assert sw.killed_by(1) == "" and sw.killed_by("timeout") == ""
    line = "[  982.7] Out of memory: Killed process 2380 (python) total-vm:242242692kB"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "x\n" + line + "\n", ""))
    assert sw.killed_by(-signal.SIGKILL) == f" (SIGKILL; {line})"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "", ""))
    assert "OOM killer" in sw.killed_by(-signal.SIGKILL)


def test_profile_train_passes_through_and_brings_the_tables_back(tmp_path, monkeypatch):
    import argparse

    run = {r.id: r for r in sw.plan_runs()}["0.5b-full-rlcli-sglang"]
    args = argparse.Namespace(steps=None, tiny=False, model_cache=tmp_path / "m", work=tmp_path / "w",
                              out=tmp_path / "out", profile_train=True)
    cmd = sw.command(run, args)
    assert cmd[cmd.index("--profile") + 1] == "train"

    def fake_grpo_step(cmd, **kw):  # what grpo_step.py writes into its --out
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "results.json").write_text(json.dumps({"env": {}, "results": [{"what": "rlcli", "step_s_median": 3.0}]}))
        (out / "profiles.txt").write_text("===== train-sglang: wall 1.2s\n")
        return 0, 0

    monkeypatch.setattr(sw, "run_alone", fake_grpo_step)
    rec = sw.run_one(run, args, time_left=1000)
    assert "error" not in rec and rec["profile"] == "profile-0.5b-full-rlcli-sglang.txt"
    assert (args.out / rec["profile"]).read_text().startswith("===== train-sglang")
    args.profile_train = False
    assert "--profile" not in sw.command(run, args)


def test_a_row_runs_alone_and_leaves_nothing_behind(tmp_path):
    """run_alone: a child the row left running is killed and counted; a row past its time is
    stopped with its children (an engine's worker process outliving its parent slowed a later row)."""
    import os

    import machine_state as ms

    def alive(pid: int) -> bool:  # a zombie awaiting its reaper is gone for this purpose
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    pid_file = tmp_path / "child.pid"
    spawn = f"import subprocess; p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(p.pid))"
    with (tmp_path / "log").open("w") as f:
        rc, left = ms.run_alone([sys.executable, "-c", spawn], stdout=f, env=dict(os.environ), cwd=str(tmp_path),
                                timeout=30)
    assert (rc, left) == (0, 1)
    assert not alive(int(pid_file.read_text()))

    bg_file = tmp_path / "bg.pid"
    with (tmp_path / "log").open("w") as f:
        rc, left = ms.run_alone(["sh", "-c", f"sleep 30 & echo $! > {bg_file}; sleep 30"], stdout=f,
                                env=dict(os.environ), cwd=str(tmp_path), timeout=1.0)
    assert rc == "timeout" and left == 0  # SIGTERM reached the whole group
    assert not alive(int(bg_file.read_text()))  # the shell's background child too, not only the shell


def test_a_row_started_beside_another_gpu_process_says_so():
    import machine_state as ms

    busy = {"gpus": [{"index": "0", "memory_used_mib": 70000.0, "util_pct": 100.0}],
            "processes": [{"pid": "7", "name": "/usr/bin/python3", "memory_mib": 69000.0}]}
    assert ms.foreign_note(busy) == "GPU NOT FREE at start: python3 (69000 MiB)"
    assert ms.foreign_note({**busy, "processes": []}) == "" and ms.foreign_note(None) == ""
    rec = {"id": "0.5b-full-rlcli", "shape": "0.5b", "lengths": "full", "row": "rlcli", "extra": [],
           "gpu_at_start": busy, "results": [{"what": "rlcli", "step_s_median": 1.8, "step_s_min": 1.7,
                                              "step_s_max": 1.9, "trainable_params": 5e8}]}
    text = sw.table([{**rec, "host_cpu": "AMD EPYC 9654, 16 cores"}])
    assert "GPU NOT FREE at start: python3 (69000 MiB); trains 500.0M parameters" in text
    assert "host CPU: AMD EPYC 9654, 16 cores;" in text
