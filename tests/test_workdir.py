"""The work dir: rlcli writes only what it owns, never deletes a user's files or a finished run's
results, redoes a final HF export a kill interrupted, and names the path and the fix when it
cannot use a directory (exit 2, no traceback)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlcli.cli import cli
from rlcli.fsutil import clean_interrupted
from rlcli.runner import workdir as wd
from rlcli.runner.workdir import (
    MANIFEST,
    WorkDirError,
    WorkDirInUse,
    claim_work_dir,
    plan_work_dir,
    prepare_work_dir,
)
from rlcli.train.weights import is_complete_export

SHORT = ["trainer.total_train_steps=1", "trainer.train_batch_size=10", "eval.evaluator.sample_num=10"]


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def user_dir(root: Path) -> Path:
    """The fault trial's directory: the user's own eval/, hf/, tensorboard/, rollouts/, run.log."""
    for d in ("eval", "hf/step-1", "tensorboard", "rollouts"):
        (root / d).mkdir(parents=True)
        (root / d / "mine.txt").write_text(f"the user's {d}")
    (root / "run.log").write_text("the user's log")
    return root


def train(repo: Path, work: Path, *args: str):
    return CliRunner().invoke(cli, ["train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work),
                                    "--quiet", *SHORT, *args])


def fake_run(work: Path, *, finished: dict | None = None, checkpoint: int | None = None) -> None:
    """What a run leaves in ``work``: the manifest, logged steps, an HF export, optionally a checkpoint."""
    wd._write_manifest(work, finished)
    (work / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "reward/mean": 0.5}\n')
    (work / "hf" / "step-1").mkdir(parents=True)
    (work / "hf" / "step-1" / "config.json").write_text('{"model_type": "llama"}')
    (work / "eval").mkdir()
    (work / "eval" / "step-1.jsonl").write_text("{}\n")
    if checkpoint is not None:
        (work / "checkpoints" / f"step-{checkpoint}").mkdir(parents=True)
        (work / "checkpoints" / f"step-{checkpoint}" / "COMPLETE").write_text("")


# ------------------------------------------------------------------------- ownership
@pytest.mark.parametrize("auto_resume", [True, False])
@pytest.mark.parametrize("overwrite", [True, False])
def test_a_dir_with_the_users_own_outputs_is_refused_and_untouched(tmp_path, auto_resume, overwrite):
    work = user_dir(tmp_path / "myproj")
    before = snapshot(work)
    with pytest.raises(WorkDirInUse, match="eval, hf, rollouts, run.log, tensorboard") as exc:
        prepare_work_dir(work, auto_resume=auto_resume, overwrite=overwrite)
    assert str(work) in str(exc.value) and "--work-dir" in str(exc.value)
    assert snapshot(work) == before


def test_the_cli_refuses_a_dir_of_other_files_and_names_the_overwrite_fix(repo, tmp_path):
    work = tmp_path / "proj"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    res = train(repo, work)
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert f"{work} holds files rlcli did not write (notes.txt)" in res.output and "--overwrite" in res.output
    assert snapshot(work) == {"notes.txt": b"mine"}


def test_overwrite_writes_beside_other_files_and_deletes_only_rlclis_own(tmp_path):
    work = tmp_path / "proj"
    (work / "data").mkdir(parents=True)
    (work / "data" / "train.jsonl").write_text("{}\n")
    (work / "notes.txt").write_text("mine")
    users = snapshot(work)
    assert prepare_work_dir(work, auto_resume=False, overwrite=True) is None
    assert (work / MANIFEST).is_file()
    fake_run(work)
    (work / "eval" / "base").mkdir()  # `rlcli eval` results
    (work / "eval" / "base" / "eval.jsonl").write_text("{}\n")
    with pytest.raises(WorkDirInUse, match="already holds a run"):
        prepare_work_dir(work, auto_resume=False, overwrite=False)
    prepare_work_dir(work, auto_resume=True, overwrite=True)
    left = snapshot(work)
    assert {k: v for k, v in left.items() if k in users} == users  # the user's files, byte for byte
    assert not (work / "metrics.jsonl").exists() and not (work / "hf").exists()
    assert sorted(left) == sorted([*users, MANIFEST, "eval", "eval/base", "eval/base/eval.jsonl"])


def test_a_dead_run_before_its_first_checkpoint_is_cleared_but_nothing_else(tmp_path):
    work = tmp_path / "w"
    fake_run(work)
    (work / "hf" / "notes.txt").write_text("inside rlcli's hf/: rlcli's")
    (work / "wandb").mkdir()  # another tool's output next to a run: not rlcli's, kept
    assert prepare_work_dir(work, auto_resume=True, overwrite=False) is None
    assert sorted(p.name for p in work.iterdir()) == [MANIFEST, "wandb"]


def test_a_dir_of_an_older_rlcli_is_adopted(tmp_path):
    work = tmp_path / "old"
    (work / "checkpoints" / "step-4").mkdir(parents=True)  # tests/test_checkpoint_compat.py's layout
    (work / "checkpoints" / "step-4" / "COMPLETE").write_text("")
    assert prepare_work_dir(work, auto_resume=True, overwrite=False) == work / "checkpoints" / "step-4"
    old = tmp_path / "old-finished"  # no checkpoint: it may have finished, so its results stay
    old.mkdir()
    (old / "resolved.yaml").write_text("recipe: {}\nplugins: {}\nversions: {}\n")
    (old / "metrics.jsonl").write_text('{"step": 7}\n')
    before = snapshot(old)
    with pytest.raises(WorkDirInUse, match="older rlcli that may have finished"):
        prepare_work_dir(old, auto_resume=True, overwrite=False)
    assert snapshot(old) == before


# ------------------------------------------------------------------------ reruns
def test_a_finished_run_with_no_checkpoint_is_reported_and_kept(repo, tmp_path):
    work = tmp_path / "run"
    first = train(repo, work, "trainer.checkpoint_interval=-1")
    assert first.exit_code == 0, first.output
    assert not (work / "checkpoints").exists() and is_complete_export(work / "hf" / "step-1")
    before = snapshot(work)
    again = CliRunner().invoke(cli, ["train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work),
                                     *SHORT, "trainer.checkpoint_interval=-1"])
    assert again.exit_code == 0, again.output
    assert "finished run (step 1): nothing to do" in again.output and "done:" in again.output
    changed = train(repo, work, "trainer.checkpoint_interval=-1", "trainer.seed=5")  # nothing to continue from
    assert changed.exit_code == 2 and "holds a finished run (last step 1)" in changed.output, changed.output
    assert snapshot(work) == before


def test_auto_resume_resumes_the_newest_checkpoint_even_of_a_finished_run(tmp_path):
    work = tmp_path / "w"
    fake_run(work, finished={"step": 1, "recipe": "another recipe"}, checkpoint=1)
    (work / "hf" / "step-1.tmp").mkdir()  # a killed export's leftover: rlcli's own
    assert prepare_work_dir(work, auto_resume=True, overwrite=False) == work / "checkpoints" / "step-1"
    assert (work / "metrics.jsonl").read_text().count("step") == 2 and (work / "hf" / "step-1").is_dir()
    assert not (work / "hf" / "step-1.tmp").exists()
    assert json.loads((work / MANIFEST).read_text())["finished"] is None  # running again


# ----------------------------------------------------------------- the final export
def test_a_killed_publish_is_recovered_and_a_partial_export_is_not_complete(tmp_path):
    hf = tmp_path / "hf"
    for name, config in (("step-2.old", '{"a": 1}'), ("step-3.tmp", "")):  # old swapped out, new unfinished
        (hf / name).mkdir(parents=True)
        (hf / name / "config.json").write_text(config)
        (hf / name / "model.safetensors").write_bytes(b"x")
    assert not is_complete_export(hf / "step-3.tmp")  # the kill's empty config.json
    assert clean_interrupted(hf, is_complete_export) == [hf / "step-3.tmp"]
    assert sorted(p.name for p in hf.iterdir()) == ["step-2"] and is_complete_export(hf / "step-2")


def test_sigkill_during_the_final_hf_export_then_rerun_completes_it(repo, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = tmp_path / "run"
    args = [*SHORT, "trainer.checkpoint_interval=1", "resources.num_threads=1"]  # the last step checkpointed
    killed = subprocess.run(
        [sys.executable, "-m", "rlcli.cli", "train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir",
         str(work), "--quiet", *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, "RLCLI_FAULT": "hf_export:before_publish:step-1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (work / "hf" / "step-1.tmp").is_dir() and not (work / "hf" / "step-1").exists()
    assert (work / "checkpoints" / "step-1" / "COMPLETE").is_file()
    rerun = CliRunner().invoke(cli, ["train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work),
                                     *args])
    assert rerun.exit_code == 0, rerun.output
    assert "resumed from" in rerun.output
    assert sorted(p.name for p in (work / "hf").iterdir()) == ["step-1"]
    model = AutoModelForCausalLM.from_pretrained(work / "hf" / "step-1")
    assert model.config.vocab_size >= len(AutoTokenizer.from_pretrained(work / "hf" / "step-1"))
    assert json.loads((work / MANIFEST).read_text())["finished"]["step"] == 1


@pytest.mark.slow
def test_sigkill_during_the_final_hf_export_of_a_disaggregated_run_then_rerun_completes_it(repo, tmp_path):
    work = tmp_path / "run"
    args = [sys.executable, "-m", "rlcli.cli", "train", str(repo / "recipes" / "quickstart-disaggregated.yaml"),
            "--work-dir", str(work), "--nproc-per-node", "2", "trainer.total_train_steps=2",
            "trainer.checkpoint_interval=2", "trainer.train_batch_size=20", "eval.evaluator.sample_num=20",
            "trainer.enable_initial_evaluate=false"]
    killed = subprocess.run(args, capture_output=True, text=True, timeout=300, start_new_session=True,
                            env={**os.environ, "RLCLI_FAULT": "hf_export:before_publish:step-2"})
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert (work / "hf" / "step-2.tmp").is_dir() and not (work / "hf" / "step-2").exists()
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert rerun.returncode == 0 and "resumed from" in rerun.stdout, rerun.stderr[-3000:]
    assert sorted(p.name for p in (work / "hf").iterdir()) == ["step-2"] and is_complete_export(work / "hf" / "step-2")


# ------------------------------------------------------------------ unusable paths
@pytest.mark.parametrize("where", ["file", "under a file"])
def test_a_work_dir_that_is_or_lies_under_a_file_is_named(repo, tmp_path, where):
    (tmp_path / "f").write_text("a file")
    path = tmp_path / "f" if where == "file" else tmp_path / "f" / "run"
    res = CliRunner().invoke(cli, ["train", str(repo / "recipes" / "quickstart.yaml"), f"trainer.work_dir={path}"])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    expect = f"{path} is a file" if where == "file" else f"{path} cannot be created: {tmp_path / 'f'} is a file"
    assert expect in res.output and "trainer.work_dir" in res.output


def test_a_read_only_work_dir_is_named(repo, tmp_path, monkeypatch):
    work = tmp_path / "ro"
    work.mkdir()
    work.chmod(0o555)
    if os.geteuid() == 0:  # root writes whatever the mode bits say: make the check see what a user's would
        monkeypatch.setattr(wd.os, "access", lambda p, mode, **kw: Path(p) != work)
    try:  # through the recipe field: click checks --work-dir itself
        res = CliRunner().invoke(cli, ["train", str(repo / "recipes" / "quickstart.yaml"), f"trainer.work_dir={work}"])
    finally:
        work.chmod(0o755)
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert f"{work} is not writable" in res.output and "chmod u+w" in res.output
    assert list(work.iterdir()) == []


def test_eval_claims_the_work_dir_it_writes_into_and_names_a_bad_out_dir(repo, tmp_path):
    foreign = tmp_path / "proj"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(WorkDirInUse, match="notes.txt"):
        claim_work_dir(foreign)
    assert snapshot(foreign) == {"notes.txt": b"mine"}
    fresh = tmp_path / "fresh"
    claim_work_dir(fresh)
    (fresh / "eval" / "base").mkdir(parents=True)  # what `rlcli eval` then writes: a later run keeps it
    assert plan_work_dir(fresh, auto_resume=False, overwrite=False).clear == ["eval"]
    (tmp_path / "f").write_text("a file")
    res = CliRunner().invoke(cli, ["eval", str(repo / "recipes" / "quickstart.yaml"), "--out-dir",
                                   str(tmp_path / "f" / "out"), f"trainer.work_dir={fresh}"])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert f"--out-dir {tmp_path / 'f' / 'out'} cannot be created: {tmp_path / 'f'} is a file" in res.output


def test_a_failed_manifest_write_is_named(tmp_path, monkeypatch):
    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "write_text", refuse)
    with pytest.raises(WorkDirError, match=f"cannot write into work dir {tmp_path / 'w'}: Permission denied"):
        prepare_work_dir(tmp_path / "w", auto_resume=False, overwrite=False)


def test_plan_reads_only(tmp_path):
    work = tmp_path / "w"
    fake_run(work)
    before = snapshot(work)
    assert plan_work_dir(work, auto_resume=True, overwrite=False).clear == ["eval", "hf", "metrics.jsonl"]
    assert snapshot(work) == before


# ------------------------------------------------------------------ names that look like rlcli's
def test_a_users_renamed_copies_of_rlcli_outputs_are_the_users(tmp_path):
    """Only the temporary names rlcli itself writes are its leftovers: a user who moved ``hf`` to
    ``hf.old`` keeps it through a fresh start, which clears rlcli's own leftovers only."""
    work = tmp_path / "w"
    fake_run(work)
    os.replace(work / "hf", work / "hf.old")
    os.replace(work / "metrics.jsonl", work / "metrics.jsonl.old")
    (work / "checkpoints.tmp").mkdir()
    (work / ".metrics.jsonl.x1y2.tmp").write_text("a killed write")  # rlcli's (fsutil.write_text)
    (work / "model-init.old").mkdir()  # rlcli's (publish_dir)
    users = {k: v for k, v in snapshot(work).items()
             if k.startswith(("hf.old", "metrics.jsonl.old", "checkpoints.tmp"))}
    assert prepare_work_dir(work, auto_resume=True, overwrite=False) is None
    assert {k: v for k, v in snapshot(work).items() if k in users} == users
    assert not (work / ".metrics.jsonl.x1y2.tmp").exists() and not (work / "model-init.old").exists()


def test_overwrite_removes_an_eval_link_not_what_it_points_at(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "step-100.jsonl").write_text("someone else's\n")
    work = tmp_path / "w"
    fake_run(work)
    os.replace(work / "eval", tmp_path / "old-eval")
    (work / "eval").symlink_to(shared)
    prepare_work_dir(work, auto_resume=False, overwrite=True)
    assert (shared / "step-100.jsonl").read_text() == "someone else's\n"
    assert not (work / "eval").exists() and not (work / "eval").is_symlink()


def test_atomic_writes_never_write_through_a_planted_link(tmp_path):
    from rlcli.fsutil import write_text

    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    work = tmp_path / "w"
    work.mkdir()
    for name in (MANIFEST + ".tmp", "metrics.jsonl.tmp", ".metrics.jsonl.tmp"):
        (work / name).symlink_to(precious)
    wd._write_manifest(work, None)
    write_text(work / "metrics.jsonl", "{}\n")
    assert precious.read_text() == "mine"
    assert not (work / MANIFEST).is_symlink() and json.loads((work / MANIFEST).read_text())["format"] == 1
    assert oct((work / "metrics.jsonl").stat().st_mode & 0o777) == oct(0o666 & ~wd_umask())


def wd_umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def test_report_never_replaces_a_report_html_rlcli_did_not_write(repo, tmp_path):
    work = tmp_path / "w"
    assert train(repo, work).exit_code == 0
    (work / "report.html").write_text("my notes")
    res = CliRunner().invoke(cli, ["report", str(work)])
    assert res.exit_code == 2 and "was not written by rlcli report" in res.output and "--out" in res.output
    assert (work / "report.html").read_text() == "my notes"
    (work / "report.html").unlink()
    assert CliRunner().invoke(cli, ["report", str(work)]).exit_code == 0
    assert CliRunner().invoke(cli, ["report", str(work)]).exit_code == 0  # its own page: replaced


def test_resuming_with_a_changed_recipe_says_which_keys_changed(repo, tmp_path):
    """Each checkpoint keeps its recipe; a run resumed with another logs what changed (run.log)."""
    from rlcli.config import load_recipe
    from rlcli.runner.workdir import recipe_changes, recipe_record

    work = tmp_path / "w"
    assert train(repo, work, "trainer.checkpoint_interval=1").exit_code == 0
    res = train(repo, work, "trainer.checkpoint_interval=1", "trainer.total_train_steps=2", "trainer.seed=7")
    assert res.exit_code == 0, res.output
    log = (work / "run.log").read_text()
    assert "with a changed recipe" in log and "trainer.seed: 1 -> 7; trainer.total_train_steps: 1 -> 2" in log
    quickstart = repo / "recipes" / "quickstart.yaml"
    a, b = load_recipe(quickstart), load_recipe(quickstart, ["tasks.0.sampler.prompt_repeat_k=4"])
    assert recipe_changes(recipe_record(a), a) == [] and recipe_changes(None, b) == []
    assert recipe_changes(recipe_record(a), b) == ["tasks.0.sampler.prompt_repeat_k: 8 -> 4"]
