"""Checkpoints: exact resume, atomic saves, crash leftovers, latest/prune, weights-only loads; loading
cannot run code; a full disk is reported with the file's path and leaves the previous checkpoint."""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.state_dict import get_state_dict

from rlcli.algo.loss import VanillaPolicyLoss
from rlcli.config import ModelConfig, TrainWorkerConfig
from rlcli.fsutil import WriteError, write_jsonl
from rlcli.models import tiny_model_dir
from rlcli.train import checkpoint as ckpt
from rlcli.train import checkpoint_files
from rlcli.train.data import TrainSequence
from rlcli.train.worker import TrainWorker

CFG = {"optimizer": {"lr": 5e-3, "weight_decay": 0.01}, "optimizer_steps": 2,
       "lr_scheduler": {"name": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1}, "pack_max_length": 32}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("ckpt-model") / "m", arch="qwen2", seed=3)


def make_worker(model_dir, **over) -> TrainWorker:
    return TrainWorker(model_dir, ModelConfig(), TrainWorkerConfig(**{**CFG, **over}), VanillaPolicyLoss(),
                       device="cpu", seed=0, total_steps=6)


def batch(step: int) -> list[TrainSequence]:
    rng = random.Random(100 + step)
    out = []
    for i in range(24):
        resp = [rng.randrange(4, 53) for _ in range(rng.randint(1, 4))]
        out.append(TrainSequence([rng.randrange(4, 53) for _ in range(rng.randint(2, 6))], resp, [1] * len(resp),
                                 [-3.0] * len(resp), rng.uniform(-1, 1), 1.0, i))
    return out


def weights(w: TrainWorker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in w.full_state_dict().items()}


def run(w: TrainWorker, steps) -> list[dict[str, float]]:
    return [{k: v for k, v in w.train_step(batch(s)).items() if k != "train/step_time_s"} for s in steps]


def test_exact_resume(model_dir, tmp_path):
    a = make_worker(model_dir)
    run(a, [1, 2])
    extra = {"step": 2, "sampler": {"epoch": 1, "pos": [3, 4]}, "buffer": [{"ids": [1, 2]}], "t": torch.arange(3)}
    path = a.save_checkpoint(ckpt.step_dir(tmp_path, 2), extra)
    rng_after_save = (random.random(), np.random.rand(), torch.rand(2))
    expected = run(a, [3, 4])
    expected_w = weights(a)

    b = make_worker(model_dir)
    random.seed(999), np.random.seed(999), torch.manual_seed(999)
    got_extra = b.load_checkpoint(path)
    assert (random.random(), np.random.rand()) == rng_after_save[:2] and torch.equal(torch.rand(2), rng_after_save[2])
    assert got_extra["sampler"] == extra["sampler"] and got_extra["buffer"] == extra["buffer"]
    assert torch.equal(got_extra["t"], extra["t"]) and got_extra["step"] == 2
    assert b.optimizer_steps_done == 4
    got = run(b, [3, 4])
    assert got == expected  # bit-identical losses, grad norms, LRs, every metric
    got_w = weights(b)
    assert all(torch.equal(got_w[k], expected_w[k]) for k in expected_w)


def test_checkpoint_layout_and_latest(model_dir, tmp_path):
    w = make_worker(model_dir)
    run(w, [1])
    for step in (1, 3, 2):
        w.save_checkpoint(ckpt.step_dir(tmp_path, step), {"step": step})
    p = ckpt.step_dir(tmp_path, 3)
    assert {x.name for x in p.iterdir()} == {"weights", "rank-0.pt", "extra_state.pt", "meta.json", ckpt.COMPLETE}
    assert json.loads((p / "meta.json").read_text()) == {"format": 1, "world_size": 1, "has_optimizer": True}
    assert ckpt.latest_checkpoint(tmp_path) == p
    (tmp_path / "step-10").mkdir()  # no COMPLETE marker: not a checkpoint
    (tmp_path / "step-11.tmp").mkdir()
    (tmp_path / "notes").mkdir()
    assert ckpt.latest_checkpoint(tmp_path) == p
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 2, 3]
    assert ckpt.latest_checkpoint(tmp_path / "missing") is None

    assert ckpt.prune(tmp_path, -1) == [] and ckpt.prune(tmp_path, None) == []
    removed = ckpt.prune(tmp_path, 2)
    assert removed == [ckpt.step_dir(tmp_path, 1)]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    elsewhere = tmp_path.parent / (tmp_path.name + "-kept")
    shutil.copytree(ckpt.step_dir(tmp_path, 2), elsewhere)
    (tmp_path / "step-0").symlink_to(elsewhere)  # a link rlcli did not make: never pruned, nor its target
    assert ckpt.prune(tmp_path, 1) == [ckpt.step_dir(tmp_path, 2)]
    assert (tmp_path / "step-0").is_symlink() and ckpt.is_complete(elsewhere)


def test_prune_takes_the_complete_marker_first(model_dir, tmp_path, monkeypatch):
    """A process killed while pruning never leaves a partial checkpoint that looks complete."""
    w = make_worker(model_dir)
    for step in (1, 2):
        w.save_checkpoint(ckpt.step_dir(tmp_path, step), {"step": step})

    def killed(path, *a, **k):
        raise KeyboardInterrupt  # the process dies before it deletes anything of the directory

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.prune(tmp_path, 1)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2]


def test_a_resumed_run_follows_the_recipes_lr_schedule(model_dir, tmp_path):
    """The schedule is the recipe's: unchanged, the LRs match the uninterrupted run's bit for bit;
    changed (here cosine to constant), the resumed run follows the new one from the saved step."""
    a = make_worker(model_dir)
    run(a, [1, 2])
    path = a.save_checkpoint(ckpt.step_dir(tmp_path, 2), {"step": 2})
    same = make_worker(model_dir)
    same.load_checkpoint(path)
    assert [g["lr"] for g in same.optimizer.param_groups] == [g["lr"] for g in a.optimizer.param_groups]
    assert same.scheduler.get_last_lr() == a.scheduler.get_last_lr()
    changed = make_worker(model_dir, lr_scheduler={"name": "constant"})
    changed.load_checkpoint(path)
    assert changed.scheduler.last_epoch == a.scheduler.last_epoch
    assert [g["lr"] for g in changed.optimizer.param_groups] == [5e-3] * len(a.optimizer.param_groups)
    assert changed.scheduler.lr_lambdas[0].name == "constant"


def test_crash_mid_save_keeps_previous_checkpoint(model_dir, tmp_path, monkeypatch):
    w = make_worker(model_dir)
    run(w, [1])
    good = w.save_checkpoint(ckpt.step_dir(tmp_path, 1), {"step": 1})
    before = weights(w)
    run(w, [2])

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(checkpoint_files.dcp, "save", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        w.save_checkpoint(ckpt.step_dir(tmp_path, 2), {"step": 2})
    monkeypatch.undo()
    assert (tmp_path / "step-2.tmp").is_dir() and not (tmp_path / "step-2").exists()
    assert ckpt.latest_checkpoint(tmp_path) == good  # the leftover is ignored

    fresh = make_worker(model_dir)
    assert fresh.load_checkpoint(ckpt.latest_checkpoint(tmp_path)) == {"step": 1}
    after = weights(fresh)
    assert all(torch.equal(before[k], after[k]) for k in before)

    w.save_checkpoint(ckpt.step_dir(tmp_path, 3), {"step": 3})  # the next save cleans the leftover
    assert not (tmp_path / "step-2.tmp").exists()
    assert ckpt.latest_checkpoint(tmp_path) == ckpt.step_dir(tmp_path, 3)


def test_overwrite_and_interrupted_replace(model_dir, tmp_path):
    w = make_worker(model_dir)
    run(w, [1])
    p = w.save_checkpoint(ckpt.step_dir(tmp_path, 5), {"v": 1})
    w.save_checkpoint(p, {"v": 2})
    assert make_worker(model_dir).load_checkpoint(p) == {"v": 2}
    assert sorted(x.name for x in tmp_path.iterdir()) == ["step-5"]
    # a crash between moving the old copy aside and renaming the new one: the old copy comes back
    p.rename(tmp_path / "step-5.old")
    (tmp_path / "step-5.tmp").mkdir()
    assert ckpt.latest_checkpoint(tmp_path) is None
    ckpt.clean_incomplete(tmp_path)
    assert ckpt.latest_checkpoint(tmp_path) == p and not (tmp_path / "step-5.tmp").exists()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        w.load_checkpoint(tmp_path / "step-9")


def test_no_optimizer_and_weights_only(model_dir, tmp_path):
    a = make_worker(model_dir)
    run(a, [1, 2])
    path = a.save_checkpoint(ckpt.step_dir(tmp_path, 2), {"step": 2}, no_optimizer=True)
    assert json.loads((path / "meta.json").read_text())["has_optimizer"] is False
    saved = weights(a)
    lr = a.optimizer.param_groups[0]["lr"]

    b = make_worker(model_dir)
    b.load_checkpoint(path)
    assert all(torch.equal(saved[k], v) for k, v in weights(b).items())
    assert not b.optimizer.state  # fresh optimizer
    assert b.optimizer_steps_done == 4 and b.optimizer.param_groups[0]["lr"] == pytest.approx(lr)

    c = make_worker(model_dir)
    with_optim = a.save_checkpoint(ckpt.step_dir(tmp_path, 3), {"step": 3})
    state = torch.get_rng_state()
    assert c.load_checkpoint(with_optim, weights_only=True) == {"step": 3}
    assert all(torch.equal(saved[k], v) for k, v in weights(c).items())
    assert not c.optimizer.state and c.optimizer_steps_done == 0
    assert torch.equal(torch.get_rng_state(), state)  # RNG untouched


def test_rng_state_round_trip():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = ckpt.capture_rng_state()
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    ckpt.restore_rng_state(state)
    again = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])


def test_new_checkpoints_hold_only_plain_data(model_dir, tmp_path):
    """Every ``*.pt`` loads with a bare ``weights_only=True``; numpy's RNG key is a list of ints."""
    w = make_worker(model_dir)
    run(w, [1])
    p = w.save_checkpoint(ckpt.step_dir(tmp_path, 1), {"step": 1})
    rank_state = torch.load(p / "rank-0.pt", weights_only=True)
    assert isinstance(rank_state["rng"]["numpy"][1], list) and len(rank_state["rng"]["numpy"][1]) == 624
    assert torch.load(p / "extra_state.pt", weights_only=True) == {"step": 1}
    with pytest.raises(TypeError, match=r"extra_state.pt: .*only tensors and plain data.*holds .*numpy.ndarray"):
        w.save_checkpoint(ckpt.step_dir(tmp_path, 2), {"step": 2, "key": np.zeros(3)})


class Hostile:
    """Unpickling it runs code: it creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def plant(kind: str, path: Path, marker: Path, w: TrainWorker) -> None:
    """Replace one file of the checkpoint at ``path`` by one that runs code when unpickled."""
    if kind == "weights/.metadata":
        (path / kind).write_bytes(pickle.dumps(Hostile(marker)))
    elif kind == "optimizer entry":  # a param-group hyperparameter inside the DCP shards
        w.model.reshard()
        msd, osd = get_state_dict(w.model, w.optimizer)
        osd["param_groups"][0]["lr"] = Hostile(marker)
        shutil.rmtree(path / "weights")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path / "weights"))
    else:
        torch.save({"rng": Hostile(marker), "step": 1}, path / kind)


def load_as_before(kind: str, path: Path, w: TrainWorker) -> None:
    """How rlcli read that file before issue 28 (to prove the planted file does run code)."""
    if kind == "weights/.metadata":
        pickle.loads((path / kind).read_bytes())
    elif kind == "optimizer entry":
        msd, osd = get_state_dict(w.model, w.optimizer)
        with contextlib.suppress(Exception):
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path / "weights"))
    else:
        torch.load(path / kind, weights_only=False)


@pytest.mark.parametrize("kind", ["extra_state.pt", "rank-0.pt", "weights/.metadata", "optimizer entry"])
def test_a_checkpoint_that_runs_code_is_refused_unrun(model_dir, tmp_path, kind):
    w = make_worker(model_dir)
    run(w, [1])
    path = w.save_checkpoint(ckpt.step_dir(tmp_path, 1), {"step": 1})
    marker = tmp_path / "MARKER"
    plant(kind, path, marker, w)
    fresh = make_worker(model_dir)
    with pytest.raises(ckpt.CheckpointError, match="refused to load.*builtins.exec.*cannot run code") as got:
        fresh.load_checkpoint(path)
    assert str(path / kind.replace("optimizer entry", "weights")) in str(got.value)
    assert not marker.exists(), "loading the checkpoint ran its code"
    load_as_before(kind, path, fresh)
    assert marker.exists(), "the planted file does not run code: the test proves nothing"


def test_full_disk_during_a_checkpoint_write_keeps_the_previous_one(model_dir, tmp_path, monkeypatch):
    """ENOSPC from the kernel (/dev/full) in each kind of write: a message with the path, no
    ``step-N.tmp`` left to fill the disk, the previous checkpoint loads as saved."""
    w = make_worker(model_dir)
    run(w, [1])
    good = w.save_checkpoint(ckpt.step_dir(tmp_path, 1), {"step": 1})
    before = weights(w)
    run(w, [2])
    real_open = builtins.open

    def open_full(path, mode="r", *args, **kwargs):  # the writes of step 2 hit a full disk
        return real_open("/dev/full" if "step-2" in str(path) and "w" in mode else path, mode, *args, **kwargs)

    @contextlib.contextmanager
    def stream_full(fs, path, mode):
        with open_full(path, mode) as f:
            yield f

    for target, name, fake in [(checkpoint_files, "open", open_full),  # rank-0.pt
                               (dcp_filesystem.FileSystem, "create_stream", stream_full)]:  # DCP's shards
        with monkeypatch.context() as m:
            m.setattr(target, name, fake, raising=False)
            with pytest.raises(WriteError) as got:
                w.save_checkpoint(ckpt.step_dir(tmp_path, 2), {"step": 2})
        msg = str(got.value)
        assert got.value.errno == errno.ENOSPC and "No space left on device" in msg, msg
        assert f"cannot write {tmp_path / 'step-2.tmp'}" in msg and f"previous checkpoint {good} is intact" in msg
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    fresh = make_worker(model_dir)
    assert fresh.load_checkpoint(ckpt.latest_checkpoint(tmp_path)) == {"step": 1}
    assert all(torch.equal(before[k], v) for k, v in weights(fresh).items())


def test_a_swallowed_write_error_on_a_full_disk_is_reported_as_one(model_dir, tmp_path, monkeypatch):
    """torch's zip writer can lose the OSError of a full disk (``unexpected pos``): a full device names it."""
    w = make_worker(model_dir)
    run(w, [1])

    def lost(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint_files.dcp, "save", lost)
    with pytest.raises(RuntimeError, match="unexpected pos"):  # room on the disk: not a full disk
        w.save_checkpoint(ckpt.step_dir(tmp_path, 1), {"step": 1})
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 4096))
    with pytest.raises(WriteError, match=r"cannot write .*step-1.tmp/weights: No space left on device"):
        w.save_checkpoint(ckpt.step_dir(tmp_path, 1), {"step": 1})


def test_full_disk_during_an_eval_write(tmp_path, monkeypatch):
    """The eval files (and every JSONL rlcli writes) name the path; the previous file stays."""
    from rlcli import fsutil

    out = tmp_path / "eval" / "step-4.jsonl"
    write_jsonl(out, [{"a": 1}])
    full = tmp_path / "eval" / ".step-4.jsonl.full.tmp"

    def full_disk_tmp(path):  # the temporary file on a full device
        full.symlink_to("/dev/full")
        return full

    monkeypatch.setattr(fsutil, "new_tmp", full_disk_tmp)
    with pytest.raises(WriteError, match=f"cannot write {out}: No space left on device; free space"):
        write_jsonl(out, [{"a": 2}])
    assert out.read_text() == '{"a": 1}\n' and not full.is_symlink()


FIXTURE = Path(__file__).resolve().parent / "data" / "ckpt-v0" / "colocate"


def rlcli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlcli.cli", *args], capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.mark.parametrize("command", ["eval", "train"])
def test_the_cli_refuses_a_checkpoint_that_runs_code(tmp_path, command):
    """``rlcli eval --checkpoint`` and auto-resume: exit 2, the file named, the code never run."""
    shutil.copy(FIXTURE / "recipe.yaml", tmp_path / "recipe.yaml")  # auto_resume: true
    shutil.copy(FIXTURE.parent / "arith.jsonl", tmp_path / "arith.jsonl")
    path = tmp_path / "work" / "checkpoints" / "step-4"
    shutil.copytree(FIXTURE / "checkpoints" / "step-4", path)
    marker = tmp_path / "MARKER"
    torch.save({"step": Hostile(marker)}, path / "extra_state.pt")
    if command == "eval":
        r = rlcli("eval", str(tmp_path / "recipe.yaml"), "--checkpoint", str(path), "--out-dir", str(tmp_path / "out"))
    else:
        r = rlcli("train", str(tmp_path / "recipe.yaml"), "--work-dir", str(tmp_path / "work"), "--quiet")
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"{path / 'extra_state.pt'}: refused to load: it names builtins.exec" in r.stderr
    assert "Traceback" not in r.stderr and not marker.exists()


def test_rlcli_eval_names_what_its_checkpoint_is_instead_before_any_model_loads(tmp_path, monkeypatch):
    """--checkpoint on a work dir, its checkpoints/ or an empty dir: exit 2 with what eval loads and,
    where there is one, the newest export or checkpoint to name instead; nothing is built first."""
    from click.testing import CliRunner

    import rlcli.runner.eval_command as ec
    from rlcli.cli import cli

    def no_build(*a, **kw):
        raise AssertionError("the run's environment was built before --checkpoint was checked")

    monkeypatch.setattr(ec, "Environment", no_build)
    shutil.copy(FIXTURE / "recipe.yaml", tmp_path / "recipe.yaml")
    shutil.copy(FIXTURE.parent / "arith.jsonl", tmp_path / "arith.jsonl")
    work = tmp_path / "work"
    shutil.copytree(FIXTURE / "checkpoints" / "step-4", work / "checkpoints" / "step-4")
    (work / "checkpoints" / "step-6").mkdir()  # not complete: never the one suggested
    (work / "checkpoints" / "step-6" / "model.pt").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    head = "not a complete HF export (config.json and its safetensors weights), LoRA adapter export"
    for given, tail in ((work, f"e.g. --checkpoint {work / 'checkpoints' / 'step-4'}"),
                        (work / "checkpoints", f"e.g. --checkpoint {work / 'checkpoints' / 'step-4'}"),
                        (work / "checkpoints" / "step-6", "was not finished writing"),
                        (tmp_path / "empty", "training checkpoint (a COMPLETE marker)")):
        r = CliRunner().invoke(cli, ["eval", str(tmp_path / "recipe.yaml"), "--checkpoint", str(given)])
        assert r.exit_code == 2, r.output
        assert f"--checkpoint {given}: {head}" in r.output and tail in r.output, r.output
    (work / "hf" / "step-5").mkdir(parents=True)
    (work / "hf" / "step-5" / "config.json").write_text('{"model_type": "llama"}')
    r = CliRunner().invoke(cli, ["eval", str(tmp_path / "recipe.yaml"), "--checkpoint", str(work / "hf" / "step-5")])
    assert r.exit_code == 2 and f"--checkpoint {work / 'hf' / 'step-5'}: {head}" in r.output, r.output  # no weights
    assert "was not finished writing" in r.output
    (work / "hf" / "step-5" / "model.safetensors").write_bytes(b"")
    r = CliRunner().invoke(cli, ["eval", str(tmp_path / "recipe.yaml"), "--checkpoint", str(work)])
    assert r.exit_code == 2 and f"e.g. --checkpoint {work / 'hf' / 'step-5'}" in r.output, r.output


def test_rlcli_eval_on_a_full_disk_says_so(tmp_path, monkeypatch):
    """A real ENOSPC (``/dev/full``) while ``rlcli eval`` writes its metrics: exit 2, the path, no traceback."""
    from click.testing import CliRunner

    from rlcli import fsutil
    from rlcli.cli import cli

    shutil.copy(FIXTURE / "recipe.yaml", tmp_path / "recipe.yaml")
    shutil.copy(FIXTURE.parent / "arith.jsonl", tmp_path / "arith.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    real_tmp = fsutil.new_tmp

    def full_disk_tmp(path):  # the metrics' temporary file on a full device
        if Path(path).name != "eval_metrics.json":
            return real_tmp(path)
        full = out / ".eval_metrics.json.full.tmp"
        full.symlink_to("/dev/full")
        return full

    monkeypatch.setattr(fsutil, "new_tmp", full_disk_tmp)
    state = ckpt.capture_rng_state()  # the command seeds the process: give the test process its own back
    try:
        r = CliRunner().invoke(cli, ["eval", str(tmp_path / "recipe.yaml"), "--out-dir", str(out)])
    finally:
        ckpt.restore_rng_state(state)
    assert r.exit_code == 2, r.output
    assert f"cannot write {out / 'eval_metrics.json'}: No space left on device" in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_a_damaged_checkpoint_file_is_named(tmp_path):
    for name, read in [("extra_state.pt", checkpoint_files.load_pt), (".metadata", checkpoint_files._read_metadata)]:
        (tmp_path / name).write_bytes(b"not a checkpoint")
        with pytest.raises(ckpt.CheckpointError, match=f"{tmp_path / name}: cannot be read .*damaged"):
            read(tmp_path / name)


def test_a_launched_run_reports_a_ranks_path_error_with_exit_2(tmp_path, monkeypatch):
    """With several ranks the error comes back through the launcher: its message, exit 2."""
    from click.testing import CliRunner

    from rlcli import launch
    from rlcli.cli import cli

    def failed(*args, **kwargs):
        raise launch.RankFailed("rank 1 (exit code 1): ...traceback...",
                                {1: "WriteError: cannot write /w/checkpoints/step-8.tmp/rank-1.pt: No space left"})

    monkeypatch.setattr(launch, "launch", failed)
    shutil.copy(FIXTURE / "recipe.yaml", tmp_path / "recipe.yaml")
    shutil.copy(FIXTURE.parent / "arith.jsonl", tmp_path / "arith.jsonl")
    r = CliRunner().invoke(cli, ["train", str(tmp_path / "recipe.yaml"), "--nproc-per-node", "2"])
    assert r.exit_code == 2 and "cannot write /w/checkpoints/step-8.tmp/rank-1.pt: No space left" in r.output
    assert "traceback" not in r.output


def test_full_disk_during_the_hf_export(model_dir, tmp_path, monkeypatch):
    """safetensors reports a full disk in its own error: the export names the path, leaves no
    ``.tmp`` behind and the previous export intact."""
    from transformers import PreTrainedModel

    w = make_worker(model_dir)
    out = w.save_hf(tmp_path / "hf")
    before = sorted(p.name for p in out.iterdir())

    def full(self, *args, **kwargs):
        raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    with pytest.raises(RuntimeError, match="IoError"):  # room on the disk: not taken as a full disk
        w.save_hf(tmp_path / "hf")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 4096))
    with pytest.raises(WriteError, match=r"cannot write .*hf.tmp: No space left on device"):
        w.save_hf(tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert sorted(p.name for p in out.iterdir()) == before
