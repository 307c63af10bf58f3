"""The wandb and mlflow trackers: a short run read back with the libraries' own readers (wandb's
offline run file through `wandb leet inspect`, an MLflow file store through MlflowClient); the
missing-library error; a library failing mid-run; a resumed run continuing its tracker run."""

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rlcli.cli import cli

pytest.importorskip("wandb", reason="pip install 'rlcli[wandb]'")
pytest.importorskip("mlflow", reason="pip install 'rlcli[mlflow]'")


def _offline(mp, home):
    """No network, no login, nothing written outside ``home``."""
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_API_KEY"):
        mp.delenv(var, raising=False)
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        mp.setenv(var, str(home / "wandb-home"))


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    _offline(monkeypatch, tmp_path)


def _same(a, b) -> bool:
    a = float(a) if isinstance(a, str) else a  # metrics.jsonl writes non-finite values as "nan"/"inf"
    return (math.isnan(a) and math.isnan(b)) if math.isnan(a) else a == pytest.approx(b, rel=1e-12, abs=0)


@pytest.fixture(scope="module")
def tracked_run(repo, tmp_path_factory):
    """Two steps of the quickstart logged to wandb (offline) and mlflow (the default file store)."""
    work = tmp_path_factory.mktemp("tracked") / "run"
    with pytest.MonkeyPatch.context() as mp:
        _offline(mp, work.parent)
        out = CliRunner().invoke(cli, [
            "train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work), "--quiet",
            "trainer.total_train_steps=2", "trainer.train_batch_size=10", "trainer.evaluate_step=2",
            "trainer.exp_tracker=[{name: wandb, mode: offline, project: qs}, {name: mlflow, run_name: qs-run}]"])
        import wandb

        wandb.teardown()  # stop the wandb-core service the run started (it would idle until pytest exits)
    assert out.exit_code == 0, out.output
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    resolved = yaml.safe_load((work / "resolved.yaml").read_text())
    assert [t["name"] for t in resolved["recipe"]["trainer"]["exp_tracker"]] == ["wandb", "mlflow"]
    return work, rows, resolved


def test_mlflow_run_holds_every_row_the_recipe_and_samples(tracked_run):
    from mlflow.tracking import MlflowClient

    from rlcli.trackers.hosted import flat_params

    work, rows, resolved = tracked_run
    client = MlflowClient((work / "trackers" / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("rlcli").experiment_id])
    assert run.info.run_name == "qs-run" and run.info.status == "FINISHED"
    keys = {k for r in rows for k in r if k != "step"}
    for key in keys:
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        want = {r["step"]: r[key] for r in rows if key in r}
        assert got.keys() == want.keys(), key
        assert all(_same(want[s], got[s]) for s in want), (key, want, got)
    assert run.data.params == {k: v[:6000] for k, v in flat_params(resolved["recipe"]).items()}
    assert run.data.params["trainer.total_train_steps"] == "2"
    recipe = client.download_artifacts(run.info.run_id, "resolved.yaml", str(work.parent / "dl"))
    assert yaml.safe_load(Path(recipe).read_text()) == resolved
    for step in (1, 2):
        path = client.download_artifacts(run.info.run_id, f"samples/step-{step}.jsonl", str(work.parent / "dl"))
        samples = [json.loads(x) for x in Path(path).read_text().splitlines()]
        assert len(samples) == 2 and all(s["step"] == step and "prompt" in s and "reward" in s for s in samples)


def _wandb_records(run_file) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                         capture_output=True, text=True, timeout=120, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def test_wandb_offline_run_holds_every_row_the_recipe_and_samples(tracked_run):
    work, rows, resolved = tracked_run
    (run_file,) = (work / "trackers" / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "qs" and run["display_name"] == "run"  # default name: the work dir's
    assert {k: v for k, v in run["config"]["update"].items() if k != "_wandb"} == resolved["recipe"]
    history = {r["history"]["step"].get("num", 0): r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == [r["step"] for r in rows]
    for r in rows:
        for key, value in r.items():
            if key != "step":
                assert _same(value, history[r["step"]][key]), (r["step"], key)
    files = {f["path"] for r in records if r["type"] == "files" for f in r["files"]["files"]}
    assert "resolved.yaml" in files
    assert yaml.safe_load((run_file.parent / "files" / "resolved.yaml").read_text()) == resolved
    for step in (1, 2):
        (table,) = (run_file.parent / "files" / "media" / "table").glob(f"samples_{step}_*.table.json")
        assert f"media/table/{table.name}" in files
        data = json.loads(table.read_text())
        assert {"step", "prompt", "response", "reward"} <= set(data["columns"]) and len(data["data"]) == 2
        assert all(row[data["columns"].index("step")] == step for row in data["data"])


@pytest.mark.parametrize("tracker, library", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_missing_library_is_a_validate_error_naming_the_extra(repo, tmp_path, monkeypatch, tracker, library):
    monkeypatch.setitem(sys.modules, library, None)  # importlib.util.find_spec now answers None
    out = CliRunner().invoke(cli, ["validate", str(repo / "recipes" / "quickstart.yaml"),
                                   f"trainer.work_dir={tmp_path / 'wd'}", f"trainer.exp_tracker=[{{name: {tracker}}}]"])
    assert out.exit_code == 2, out.output
    assert "trainer.exp_tracker.0.name" in out.output and f"pip install 'rlcli[{tracker}]'" in out.output
    assert not (tmp_path / "wd").exists()


def _mlflow_tracker(work):
    from rlcli.trackers.mlflow_tracker import MlflowTracker

    t = MlflowTracker(work_dir=work)
    t.log_recipe({"trainer": {"seed": 1}}, work / "resolved.yaml")  # not written here: no artifact
    return t


def test_a_library_failing_mid_run_warns_once_and_training_logs_go_on(tmp_path, monkeypatch, caplog):
    from mlflow.tracking import MlflowClient

    from rlcli.runner.records import log_to_trackers
    from rlcli.trackers import JsonlTracker

    jsonl, hosted = JsonlTracker(work_dir=tmp_path), _mlflow_tracker(tmp_path)
    trackers = [hosted, jsonl]
    log_to_trackers(trackers, 1, {"reward/mean": 0.5}, None, 2)

    def broken(*a, **k):
        raise ConnectionError("tracking server went away")

    monkeypatch.setattr(MlflowClient, "log_batch", broken)
    with caplog.at_level(logging.WARNING):
        for step in (2, 3):
            log_to_trackers(trackers, step, {"reward/mean": 0.5}, None, 2)
    assert trackers == [jsonl]
    warnings = [r for r in caplog.records if r.name == "rlcli" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tracking server went away" in warnings[0].getMessage()
    jsonl.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    monkeypatch.setattr(MlflowClient, "set_terminated", broken)
    hosted.close()  # never raises


def test_a_resumed_run_continues_its_tracker_run(tmp_path):
    from mlflow.tracking import MlflowClient

    first = _mlflow_tracker(tmp_path)
    for step in (1, 2, 3):
        first.log(step, {"m": float(step)})  # then killed: never closed; resumed from step 1's checkpoint
    resumed = _mlflow_tracker(tmp_path)
    resumed.truncate_after(1)
    for step in (2, 3, 4):
        resumed.log(step, {"m": 10.0 * step})
    resumed.close()
    assert resumed._run_id == first._run_id
    client = MlflowClient(first.tracking_uri())
    history = [(m.step, m.value) for m in client.get_metric_history(first._run_id, "m")]
    assert sorted(history) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]  # one value per step
    fresh = _mlflow_tracker(tmp_path)  # a run that is not resumed opens a new tracker run
    fresh.log(1, {"m": 1.0})
    fresh.close()
    assert fresh._run_id != first._run_id


def test_a_tracker_without_log_samples_gets_the_rollout_texts_it_got_before():
    from rlcli.trackers import Tracker

    class Texts(Tracker):
        def __init__(self):
            super().__init__(work_dir=".")
            self.texts = []

        def log(self, step, metrics):
            pass

        def log_text(self, step, tag, text):
            self.texts.append((step, tag, text))

    t = Texts()
    t.log_samples(3, [{"prompt": "1+2=", "response": "3", "reward": 1.0},
                      {"prompt": "p", "response": "", "reward": None}])
    assert t.texts == [(3, "rollout", "**prompt** '1+2='\n\n**response** '3'\n\n**reward** 1.0"),
                       (3, "rollout", "**prompt** 'p'\n\n**response** ''\n\n**reward** 0.0")]
