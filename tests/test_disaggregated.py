"""The disaggregated runner: placements, the weight transport, the order of a sync point, every mode
on real gloo ranks, lock-step against the colocated run, SIGKILL + auto_resume without losing or
re-training a buffered group, and failing ranks.

Runs are real ``rlcli train --nproc-per-node N`` subprocesses on the CPU (a few seconds of model
work each; most of their time is process start-up).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from rlcli.cli import cli
from rlcli.runner.records import is_wall_time
from rlcli.config import TRAIN_RESOURCES, ROLLOUT_RESOURCES, resolve_placement
from rlcli.runner.disaggregated import LEDGER, _truncate_ledger, split_sequences
from rlcli.runner.disaggregated.protocol import BatchReply, GetBatch, expect
from rlcli.runner.transport import pack_bucket, unpack_bucket

RLCLI = [sys.executable, "-m", "rlcli.cli"]
RECIPE = "quickstart-disaggregated.yaml"


# ============================================================================ placements
@pytest.mark.parametrize("res, world, train, rollout", [
    ({"train_resources": {"num_workers": 1}, "rollout_resources": {"num_workers": 1}}, 2, [0], [1]),
    ({"train_resources": {"num_workers": 2}, "rollout_resources": {"num_workers": 1}}, 3, [0, 1], [2]),
    ({"train_resources": {"ranks": [2, 1]}, "rollout_resources": {"ranks": [0]}}, 3, [1, 2], [0]),
    ({"train_resources": {"ranks": [1]}, "rollout_resources": {"num_workers": 2}}, 3, [1], [0, 2]),
    ({"train_resources": {"num_workers": 2}, "rollout_resources": {"ranks": [0]}}, None, [1, 2], [0]),
])
def test_placements_resolve(res, world, train, rollout):
    assert resolve_placement(res, world) == (train, rollout, [])


@pytest.mark.parametrize("res, world, path, words", [
    ({"train_resources": {"ranks": [0, 1]}, "rollout_resources": {"ranks": [1, 2]}}, None, TRAIN_RESOURCES,
     ["overlap", "[1]"]),
    ({"train_resources": {"ranks": []}, "rollout_resources": {"num_workers": 1}}, None, TRAIN_RESOURCES + ".ranks",
     ["empty"]),
    ({"train_resources": {"num_workers": 1}, "rollout_resources": {"num_workers": 0}}, None,
     ROLLOUT_RESOURCES + ".num_workers", ["positive"]),
    ({"train_resources": {"num_workers": 1}}, None, ROLLOUT_RESOURCES, ["required"]),
    ({"train_resources": {"num_workers": 1, "ranks": [0]}, "rollout_resources": {"num_workers": 1}}, None,
     TRAIN_RESOURCES, ["exactly one"]),
    ({"train_resources": {"ranks": [0, 0]}, "rollout_resources": {"num_workers": 1}}, None,
     TRAIN_RESOURCES + ".ranks", ["more than once"]),
    ({"train_resources": {"num_workers": 2}, "rollout_resources": {"num_workers": 1}}, 2, ROLLOUT_RESOURCES,
     ["[2]", "only 2 rank(s) are launched"]),
    ({"train_resources": {"ranks": [0]}, "rollout_resources": {"ranks": [5]}}, 3, ROLLOUT_RESOURCES,
     ["[5]", "only 3"]),
    ({"train_resources": {"num_workers": 1}, "rollout_resources": {"num_workers": 1}}, 3, TRAIN_RESOURCES,
     ["[2]", "no role"]),
])
def test_bad_placements_name_both_fields(res, world, path, words):
    train, rollout, issues = resolve_placement(res, world)
    assert (train, rollout) == ([], [])
    found = {i.path: i.message for i in issues}
    assert path in found, issues
    msg = found[path]
    assert all(w in msg for w in words), msg
    assert TRAIN_RESOURCES in path + " " + msg and ROLLOUT_RESOURCES in path + " " + msg, msg


@pytest.fixture()
def no_model(monkeypatch):
    import transformers

    def boom(*a, **k):
        raise AssertionError("must fail before loading a model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr("rlcli.launch.launch", lambda *a, **k: (_ for _ in ()).throw(AssertionError("launched")))


@pytest.mark.parametrize("args, expect", [
    (["resources.train_resources={ranks: [0, 1]}", "resources.rollout_resources={ranks: [1]}"], "overlap"),
    (["resources.train_resources={ranks: []}"], "is empty"),
    (["resources.rollout_resources={num_workers: 0}"], "positive"),
    (["~resources.rollout_resources"], "required"),
    (["--nproc-per-node", "1"], "only 1 rank(s) are launched"),
    (["--nproc-per-node", "3"], "no role"),
    (["--nproc-per-node", "2", "--nnodes", "2"], "no role"),
    (["resources.train_resources={num_workers: 2}", "--nproc-per-node", "2"], "only 2 rank(s)"),
])
def test_validate_rejects_bad_placements(repo, no_model, args, expect):
    out = CliRunner().invoke(cli, ["validate", str(repo / "recipes" / RECIPE), *args])
    assert out.exit_code == 2, out.output
    assert expect in out.output
    assert TRAIN_RESOURCES in out.output and ROLLOUT_RESOURCES in out.output


def test_validate_mode_rules(repo, no_model):
    ok = CliRunner().invoke(cli, ["validate", str(repo / "recipes" / RECIPE), "--nproc-per-node", "2"])
    assert ok.exit_code == 0, ok.output
    out = CliRunner().invoke(cli, ["validate", str(repo / "recipes" / RECIPE), "tasks.0.produce_strategy={name: sync}",
                                   "trainer.train_batch_size=1", "resources.rollout_resources={num_workers: 2}",
                                   "--nproc-per-node", "3"])
    assert out.exit_code == 2, out.output
    assert "tasks.0.produce_strategy.name" in out.output and "'async'" in out.output
    colocated = CliRunner().invoke(cli, ["validate", str(repo / "recipes" / "quickstart.yaml"),
                                         "resources.train_resources={num_workers: 1}"])
    assert colocated.exit_code == 2 and "only used with trainer.mode=disaggregated" in colocated.output
    small = CliRunner().invoke(cli, ["validate", str(repo / "recipes" / RECIPE), "trainer.train_batch_size=1",
                                     "resources.rollout_resources={num_workers: 2}", "--nproc-per-node", "3"])
    assert small.exit_code == 2 and "trainer.train_batch_size=1" in small.output and ROLLOUT_RESOURCES in small.output


def test_train_checks_the_placement_before_launching(repo, tmp_path, no_model):
    out = CliRunner().invoke(cli, ["train", str(repo / "recipes" / RECIPE), "--work-dir", str(tmp_path / "w"),
                                   "--nproc-per-node", "3"])
    assert out.exit_code == 2, out.output
    assert "no role" in out.output and not (tmp_path / "w").exists()


# =============================================================================== helpers
def test_weight_buckets_round_trip_with_aliases_and_dtypes():
    emb = torch.randn(7, 3)
    bucket = [("embed.weight", emb), ("norm.weight", torch.randn(5).to(torch.bfloat16)),
              ("lm_head.weight", emb), ("pos", torch.arange(3, dtype=torch.int64)), ("scalar", torch.tensor(2.5)),
              ("empty", torch.zeros(0, 4))]
    manifest, flat = pack_bucket(bucket, version=7)
    assert manifest.version == 7 and flat.dtype == torch.uint8
    distinct = 7 * 3 * 4 + 5 * 2 + 3 * 8 + 4
    assert distinct <= flat.numel() <= distinct + 64 * 5  # the tied tensor travels once
    assert all(o % 64 == 0 for o in manifest.offsets)
    out = unpack_bucket(manifest, flat.clone())
    assert [n for n, _ in out] == [n for n, _ in bucket]
    for (_, a), (_, b) in zip(bucket, out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert out[0][1].data_ptr() == out[2][1].data_ptr()


def test_split_sequences_balances_tokens_and_keeps_order():
    from rlcli.train.data import TrainSequence

    seqs = [TrainSequence(prompt_ids=[1] * p, response_ids=[2] * r, response_mask=[1] * r, rollout_logprobs=None,
                          advantage=0.0, seq_id=i) for i, (p, r) in enumerate([(9, 9), (1, 1), (5, 5), (2, 2), (3, 6)])]
    parts = split_sequences(seqs, 2)
    assert sorted(s.seq_id for p in parts for s in p) == list(range(5))
    loads = [sum(s.num_tokens for s in p) for p in parts]
    assert max(loads) - min(loads) <= max(s.num_tokens for s in seqs)
    for p in parts:
        assert [s.seq_id for s in p] == sorted(s.seq_id for s in p)
    assert split_sequences(seqs, 1) == [seqs]
    assert [len(p) for p in split_sequences(seqs[:1], 3)] == [1, 0, 0]


def test_ledger_truncation_drops_later_steps_and_torn_lines(tmp_path):
    path = tmp_path / LEDGER
    path.write_text("".join(json.dumps({"step": s, "groups": [["t", s]]}) + "\n" for s in range(1, 7)) + '{"step": 7, "gr')
    _truncate_ledger(path, 4)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]


class _ScriptedRollout:
    """Train rank 0's view of two rollout ranks that answer from a script (no processes)."""

    def __init__(self, script):
        self.script, self.log, self.ranks = script, [], [5, 6]

    def __len__(self):
        return len(self.ranks)

    def send(self, i, msg):
        self.log.append(("send", i, msg))

    def recv(self, i, kind):
        self.log.append(("recv", i))
        return expect(self.script[i].pop(0), kind, self.ranks[i])

    def pause(self):
        self.log.append(("pause",))

    def continue_(self, model_step):
        self.log.append(("continue", model_step))

    def stop(self):
        self.log.append(("stop",))


def test_empty_expired_answer_syncs_the_previous_version_and_asks_that_rank_again():
    # behaviour 31 with two rollout ranks: rank 0 must wait for newer weights, rank 1 already answered
    from rlcli.produce import ProduceStatus
    from rlcli.runner.records import Timer
    from rlcli.runner.disaggregated import TrainSide
    from rlcli.types import Group

    def answer(gid, status=ProduceStatus.NORMAL):
        return BatchReply([Group(gid, "t", [])], status, {"rollout/samples": 1.0, "rollout/tokens": 3.0})

    expired = BatchReply([], ProduceStatus.EXPIRED_BATCH, {})
    ro = _ScriptedRollout({0: [expired, answer(1, ProduceStatus.EXPIRED_BATCH)], 1: [answer(2)]})
    side = TrainSide.__new__(TrainSide)
    side.rollout, side.timer = ro, Timer()
    side._push_weights = lambda version: ro.log.append(("weights", version))
    batch = side._collect(5)
    assert ro.log == [("send", 0, GetBatch(5)), ("send", 1, GetBatch(5)), ("recv", 0), ("recv", 1),
                      ("pause",), ("weights", 4), ("continue", 4),
                      ("send", 0, GetBatch(5)), ("recv", 0)]
    assert [g.group_id for g in batch.groups] == [1, 2]  # in rollout-rank order, nothing asked twice
    assert batch.expired  # rank 0's producer still waits: the step ends with a sync
    assert batch.metrics["sync/expired_retries"] == 1 and batch.metrics["rollout/tokens"] == 6
    assert batch.metrics["timing/wait_for_batch_s"] >= 0


def test_sync_points_push_evaluate_and_save_while_production_is_paused(tmp_path, monkeypatch):
    # behaviour 32: at a sync point the producer is paused, then weights -> eval -> (the step's row)
    # -> checkpoint -> continue_produce; nothing of it runs while the producer runs. XTuner saves
    # first; rlcli logs the row before the checkpoint (docs/disaggregated.md), which changes no content.
    from rlcli.produce import ProduceStatus
    from rlcli.runner.disaggregated import TrainSide, train_side
    from rlcli.runner.records import Timer
    from rlcli.runner.schedule import Schedule
    from rlcli.types import Group

    def answer(step):  # step 3's producer reached its bound: that step ends with an early sync
        return BatchReply([Group(step, "t", [])], ProduceStatus.EXPIRED_BATCH if step == 3 else ProduceStatus.NORMAL, {})

    ro = _ScriptedRollout({0: [answer(t) for t in range(1, 6)]})
    ro.ranks = [5]
    side = TrainSide.__new__(TrainSide)
    side.rollout, side.timer, side.step, side.quiet, side.work_dir, side.recipe = ro, Timer(), 0, True, tmp_path, None
    side.schedule = Schedule(total_steps=5, sync_interval=2, evaluate=True, initial_evaluate=True, evaluate_step=2,
                             checkpoint_interval=2, hf_interval=None)
    side._push_weights = lambda version: ro.log.append(("weights", version))
    side._evaluate = lambda step: ro.log.append(("eval", step)) or {}
    side._save_checkpoint = lambda step: ro.log.append(("save", step))
    side._export_hf = lambda step: ro.log.append(("hf", step))
    side._train = lambda groups: ro.log.append(("train", [g.group_id for g in groups])) or {}
    side._log = lambda step, metrics, groups=None: ro.log.append(("log", step)) or metrics
    side._record = side._op = lambda *a: None
    monkeypatch.setattr(train_side, "mark_finished", lambda *a: None)
    side._coordinate()
    events = [e for e in ro.log if e[0] != "recv"]
    paused_sync = {2: [("eval", 2), ("log", 2), ("save", 2)], 3: [("log", 3)], 4: [("eval", 4), ("log", 4), ("save", 4)],
                   5: [("eval", 5), ("log", 5)]}
    want = [("weights", 0), ("eval", 0), ("log", 0), ("continue", 0)]
    for t in range(1, 6):
        want += [("send", 0, GetBatch(t)), ("train", [t])]
        if t in paused_sync:
            want += [("pause",), ("weights", t), *paused_sync[t], ("continue", t) if t < 5 else ("stop",)]
        else:
            want.append(("log", t))
    assert events == want + [("hf", 5)]
    running = False  # the producer: started by continue_produce, stopped by a pause or stop
    for e in events:
        running = e[0] == "continue" or (running and e[0] not in ("pause", "stop"))
        assert not (running and e[0] in ("weights", "eval", "save")), events


def test_every_message_kind_pickles_and_names_its_reply():
    import dataclasses
    import pickle

    from rlcli.produce import ProduceStatus
    from rlcli.runner.disaggregated import protocol as p
    from rlcli.types import Group

    messages = [p.GetBatch(3), p.PauseProduce(), p.ContinueProduce(2), p.SyncWeights(2), p.Evaluate(4),
                p.SaveCheckpoint(4), p.Stop(), p.TrainStep(), p.ExportHF(5), p.Paused(), p.Stopped(),
                p.BatchReply([Group(1, "t", [])], ProduceStatus.NORMAL, {"rollout/tokens": 3.0}),
                p.EvalReply([], {"eval/judge/calls": 1.0})]
    for m in messages:
        assert dataclasses.is_dataclass(m) and type(m).__dataclass_params__.frozen, m
        assert pickle.loads(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)) == m
    replies = {c.__name__: c.reply for c in (p.GetBatch, p.PauseProduce, p.ContinueProduce, p.SyncWeights,
                                             p.Evaluate, p.SaveCheckpoint, p.Stop)}
    assert replies == {"GetBatch": p.BatchReply, "PauseProduce": p.Paused, "ContinueProduce": None,
                       "SyncWeights": None, "Evaluate": p.EvalReply, "SaveCheckpoint": None, "Stop": p.Stopped}
    empty = p.BatchReply([], ProduceStatus.EXPIRED_BATCH, {})
    assert empty.expired and empty.waits_for_weights
    assert messages[11].expired is False and not messages[11].waits_for_weights


def test_a_wrong_reply_or_an_unknown_command_is_named(monkeypatch):
    from types import SimpleNamespace

    from rlcli.runner.disaggregated import RolloutSide, rollout_side
    from rlcli.runner.disaggregated.protocol import Paused

    with pytest.raises(RuntimeError, match=r"rollout rank 6 answered Paused\(\), expected a BatchReply"):
        expect(Paused(), BatchReply, 6)
    side = RolloutSide.__new__(RolloutSide)
    side.placement, side.ch, side.boot = SimpleNamespace(train0=0), SimpleNamespace(command=None), SimpleNamespace(rank=1)
    monkeypatch.setattr(rollout_side, "recv", lambda src, group: ("batch", 5))
    with pytest.raises(RuntimeError, match=r"rollout rank 1: unknown command \('batch', 5\) from train rank 0"):
        side.run()


# ================================================================================ runs
MODES = {
    # name: (overrides, stale_threshold = (max_staleness + 1) * sync_weights_interval, ranks)
    "on_policy_lockstep": ([
        "tasks.0.produce_strategy={name: async, over_sample_threshold: 0, max_staleness: 0}",
        "trainer.sync_weights_interval=1", "trainer.evaluate_step=5"], 1, 2),
    "stream_off_policy": ([
        "tasks.0.produce_strategy={name: async, over_sample_threshold: 0, max_staleness: 0}",
        "trainer.sync_weights_interval=2", "trainer.evaluate_step=2"], 2, 2),
    "async_stale": ([
        "tasks.0.produce_strategy={name: async, over_sample_threshold: 0.5, max_staleness: 1, "
        "tail_batch_trigger_size: 0, tail_batch_max_tries: 3}",
        "trainer.sync_weights_interval=1", "trainer.evaluate_step=5",
        "resources.train_resources={ranks: [1, 2]}", "resources.rollout_resources={ranks: [0]}"], 2, 3),
    "async_partial_rollout": ([
        "tasks.0.produce_strategy={name: async, over_sample_threshold: 0.5, max_staleness: 1, "
        "enable_partial_rollout: true, tail_batch_trigger_size: 0}",
        "trainer.sync_weights_interval=2", "trainer.evaluate_step=2",
        "resources.train_resources={num_workers: 1}", "resources.rollout_resources={num_workers: 2}"], 4, 3),
}


def train_args(repo: Path, work: Path, ranks: int, steps: int, *overrides: str) -> list[str]:
    return [*RLCLI, "train", str(repo / "recipes" / RECIPE), "--work-dir", str(work), "--quiet",
            "--nproc-per-node", str(ranks), f"trainer.total_train_steps={steps}", "trainer.train_batch_size=20",
            "eval.evaluator.sample_num=20", "trainer.enable_initial_evaluate=false", "trainer.checkpoint_interval=-1",
            "trainer.exp_tracker=[{name: jsonl}]", *overrides]


def run(args: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """A run in its own session: whatever happens, none of its processes outlives the test."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        _kill_session(proc)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _live_members(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` still running (zombies waiting to be reaped do not count)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


def rows(work: Path) -> list[dict]:
    return [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]


def ledger(work: Path) -> list[dict]:
    return [json.loads(x) for x in (work / LEDGER).read_text().splitlines()]


@pytest.fixture(scope="module")
def mode_run(repo, tmp_path_factory):
    """Each mode's five-step run, made once per module (the lock-step run serves two tests)."""
    done: dict[str, Path] = {}

    def get(mode: str) -> Path:
        if mode not in done:
            overrides, _, ranks = MODES[mode]
            work = tmp_path_factory.mktemp(mode) / "run"
            r = run(train_args(repo, work, ranks, 5, *overrides))
            assert r.returncode == 0, r.stderr[-4000:]
            done[mode] = work
        return done[mode]

    return get


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_runs_five_steps_within_its_staleness_bound(mode_run, mode):
    overrides, threshold, ranks = MODES[mode]
    work = mode_run(mode)
    steps = rows(work)
    assert [x["step"] for x in steps] == [1, 2, 3, 4, 5]
    interval = 2 if "trainer.sync_weights_interval=2" in overrides else 1
    for x in steps:
        # every trained sample is within the bound, and the producer never ran further ahead than it allows
        assert 0 <= x["rollout/staleness_max"] <= threshold - 1, (x["step"], x["rollout/staleness_max"])
        assert x["rollout/producer_lead_steps"] <= threshold - 1, x
        assert x["rollout/groups"] == 20 and x["train/sequences"] == 160
        for key in ("timing/wait_for_batch_s", "timing/rollout_idle_s", "timing/train_s", "timing/step_s",
                    "reward/mean", "train/loss", "rollout/staleness_mean"):
            assert key in x, key
        # throughput: trained tokens per second of the train phase; generated tokens per second of
        # generating (rollout ranks, summed; sampled every 10 ms, so a short step may read 0)
        assert x["throughput/train_tokens_per_s"] == pytest.approx(x["train/tokens"] / x["timing/train_s"])
        assert x["throughput/rollout_tokens_per_s"] >= 0
        if x["step"] % interval == 0 or x["step"] == 5:  # a sync step
            assert x["sync/synced"] == 1 and x["sync/bytes"] > 0 and x["sync/weights_s"] > 0
    assert sum(x["throughput/rollout_tokens_per_s"] for x in steps) > 0
    if threshold == 1:
        assert all(x["rollout/staleness_max"] == 0 for x in steps)  # on-policy: every sample from policy t-1
    assert "eval/accuracy" in steps[-1]
    trained = [tuple(g) for row in ledger(work) for g in row["groups"]]
    assert [row["step"] for row in ledger(work)] == [1, 2, 3, 4, 5]
    assert len(trained) == len(set(trained)) == 100
    assert (work / "hf" / "step-5" / "config.json").exists()


def test_lockstep_reproduces_the_colocated_run(repo, mode_run, tmp_path):
    """docs/disaggregated.md: on-policy lock-step is the colocated strict on-policy run on separate
    ranks. Same data, policy versions and seeds: every metric that is not a wall time, every dumped
    rollout and eval sample, and the final weights are identical. The colocated run also derives its
    5 steps from trainer.total_epochs (behaviour 38: 100 prompts // 20 per step × 1 epoch) and
    reports its throughput, to metrics.jsonl and TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dis, col = mode_run("on_policy_lockstep"), tmp_path / "colocated"
    res = CliRunner().invoke(cli, [
        "train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(col), "--quiet",
        "trainer.total_train_steps=null", "trainer.total_epochs=1", "trainer.train_batch_size=20",
        "eval.evaluator.sample_num=20", "trainer.enable_initial_evaluate=false", "trainer.checkpoint_interval=-1",
        "trainer.evaluate_step=5", "trainer.exp_tracker=[{name: jsonl}, {name: tensorboard}]"])
    assert res.exit_code == 0, res.output
    a, b = rows(dis), rows(col)
    assert [x["step"] for x in b] == [x["step"] for x in a] == [1, 2, 3, 4, 5]
    for x, y in zip(a, b):
        # the disaggregated row adds its sync/ and wait metrics; only the colocated engine sleeps and wakes
        assert set(y) - {"timing/sleep_s", "timing/wake_up_s"} <= set(x), set(y) - set(x)
        assert "timing/sleep_s" in y and "timing/sleep_s" not in x
        # (the start-up push is no step's in either mode: step 1's sync/bytes match too)
        differ = {k: (x[k], y[k]) for k in set(y) & set(x) if not is_wall_time(k) and x[k] != y[k]}
        assert not differ, (y["step"], differ)
        assert y["throughput/rollout_tokens_per_s"] == pytest.approx(y["rollout/tokens"] / y["timing/rollout_s"])
        assert y["throughput/train_tokens_per_s"] == pytest.approx(y["train/tokens"] / y["timing/train_s"])
    for name in [f"rollouts/step-{t}.jsonl" for t in range(1, 6)] + ["eval/step-5.jsonl", "hf/step-5/model.safetensors"]:
        assert (dis / name).read_bytes() == (col / name).read_bytes(), name
    events = EventAccumulator(str(col / "tensorboard")).Reload()
    tb = events.Scalars("throughput/train_tokens_per_s")
    assert [e.step for e in tb] == [1, 2, 3, 4, 5]
    assert [e.value for e in tb] == pytest.approx([y["throughput/train_tokens_per_s"] for y in b], rel=1e-6)


def _group_ids(manager_state: dict) -> list[tuple[str, int]]:
    return [(e["task"], e["group"]["group_id"]) for e in manager_state["buffer"]["entries"]]


@pytest.mark.slow
def test_sigkill_then_auto_resume_loses_and_repeats_no_buffered_group(repo, tmp_path):
    overrides = [
        "tasks.0.produce_strategy={name: async, over_sample_threshold: 0.5, max_staleness: 1, "
        "enable_partial_rollout: true, tail_batch_trigger_size: 0}",
        "trainer.sync_weights_interval=2", "trainer.evaluate_step=4", "trainer.checkpoint_interval=4",
        "trainer.checkpoint_maxkeep=-1", "trainer.auto_resume=true",
        "resources.train_resources={num_workers: 1}", "resources.rollout_resources={num_workers: 2}"]
    work = tmp_path / "run"
    args = train_args(repo, work, 3, 12, *overrides)
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 180
        # kill mid-run: after the step-4 checkpoint, once step 6 has been trained (it is trained again on resume)
        while not ((work / "checkpoints" / "step-4" / "COMPLETE").exists() and (work / LEDGER).exists()
                   and any(json.loads(x).get("step") == 6 for x in (work / LEDGER).read_text().splitlines()
                           if x.endswith("}"))):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline, "no step 6 in time"
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        _kill_session(proc)
    assert not (work / "checkpoints" / "step-12").exists(), "the run finished before the kill; the test proves nothing"
    saved = torch.load(work / "checkpoints" / "step-4" / "extra_state.pt", weights_only=True)
    assert saved["step"] == 4 and len(saved["managers"]) == 2
    buffered_at_kill = {g for m in saved["managers"] for g in _group_ids(m)}
    assert buffered_at_kill, "nothing was buffered at the checkpoint; the test proves nothing"

    r = run(args)
    assert r.returncode == 0, r.stderr[-4000:]
    assert [x["step"] for x in rows(work)] == list(range(1, 13))
    book = ledger(work)
    assert [row["step"] for row in book] == list(range(1, 13))
    trained = [tuple(g) for row in book for g in row["groups"]]
    assert len(trained) == len(set(trained)) == 12 * 20, "a group was trained twice"
    final = torch.load(work / "checkpoints" / "step-12" / "extra_state.pt", weights_only=True)
    buffered = {g for m in final["managers"] for g in _group_ids(m)}
    sampled = set()
    n = len(final["managers"])
    for i, m in enumerate(final["managers"]):
        assert m["buffer"]["discarded_expired"] == 0
        sampled |= {("arith", k * n + i) for k in range(m["samplers"]["arith"]["groups_sampled"])}
    # conservation: every group ever sampled was trained exactly once or is still in a buffer
    assert not set(trained) & buffered
    assert set(trained) | buffered == sampled
    trained_after = {tuple(g) for row in book if row["step"] > 4 for g in row["groups"]}
    assert buffered_at_kill <= trained_after | buffered  # the checkpoint's buffered groups survived the kill


@pytest.mark.parametrize("side, overrides, expect", [
    ("rollout", ["tasks.0.sampler.prompt_repeat_k=1", "tasks.0.group_filters=[{name: all_equal_rewards}]",
                 "tasks.0.produce_strategy.max_filtered_groups=5"], "filtered out"),
    ("train", ["train_worker.pack_max_length=2"], "more than pack_max_length=2"),
])
def test_a_failing_rank_ends_the_run_with_its_traceback(repo, tmp_path, side, overrides, expect):
    work = tmp_path / side
    t0 = time.time()
    proc = subprocess.Popen(train_args(repo, work, 2, 5, *overrides), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=150)
        time.sleep(0.5)
        left = _live_members(proc.pid)
    finally:
        _kill_session(proc)
    assert proc.returncode == 1, err[-4000:]
    assert "training failed" in err and expect in err and "Traceback" in err, err[-4000:]
    # Either rank may exit first: the launcher then reports rank 1 itself, or train rank 0 relays it.
    named = ("rollout rank 1 failed", "rank 1 (exit code") if side == "rollout" else ("rank 0",)
    assert any(n in err for n in named), err[-4000:]
    assert time.time() - t0 < 120
    assert not left, f"rank processes {left} outlived the failed run"


@pytest.mark.slow
def test_quickstart_disaggregated_learns(repo, tmp_path):
    work = tmp_path / "qs"
    r = run([*RLCLI, "train", str(repo / "recipes" / RECIPE), "--work-dir", str(work), "--quiet",
             "--nproc-per-node", "2"], timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    evals = {x["step"]: x["eval/accuracy"] for x in rows(work) if "eval/accuracy" in x}
    assert evals[0] <= 0.3 and max(evals) == 300 and evals[300] >= 0.9, evals
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == ["step-200", "step-300"]
    assert all(x["rollout/staleness_max"] <= 1 for x in rows(work)[1:])
