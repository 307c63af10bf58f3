"""The one schedule both runners ask: what is due at a step (sync, eval, checkpoint, HF export),
the colocated ``model_step``, and a rank's share of the batch."""

import itertools

import pytest
import yaml

from rlcli.config import validate_recipe
from rlcli.runner.schedule import Schedule, share, total_train_steps

DISABLED = (None, 0, -1)


def sched(total=10, **kw) -> Schedule:
    return Schedule(total_steps=total, **kw)


def due(fn, total) -> list[int]:
    return [s for s in range(total + 1) if fn(s)]


# ------------------------------------------------------------------------------ weight sync
@pytest.mark.parametrize("interval, total, expect", [
    (1, 4, [0, 1, 2, 3, 4]),
    (2, 5, [0, 2, 4, 5]),  # the last step always syncs
    (3, 7, [0, 3, 6, 7]),
    (4, 8, [0, 4, 8]),
])
def test_sync_every_interval_and_at_the_last_step(interval, total, expect):
    assert due(sched(total, sync_interval=interval).sync_due, total) == expect


def test_a_waiting_producer_forces_an_early_sync():
    s = sched(10, sync_interval=4)
    assert s.sync_due(3, expired=True) and not s.sync_due(3)
    assert s.early_sync(3, expired=True)
    assert not s.early_sync(4, expired=True)  # a regular sync point anyway
    assert not s.early_sync(10, expired=True)  # the last step anyway
    assert not s.early_sync(3, expired=False)


# ------------------------------------------------------------------------------- evaluation
def test_eval_at_sync_points_every_evaluate_step_and_at_the_last_step():
    s = sched(10, sync_interval=2, evaluate=True, evaluate_step=4)
    assert due(s.eval_due, 10)[1:] == [4, 8, 10]  # (0 % 4 == 0 too: the runners never ask for step 0)
    assert sched(7, evaluate=True, evaluate_step=5).eval_due(7)  # last step, not a multiple


def test_no_eval_when_evaluation_is_off():
    s = sched(10, sync_interval=2, evaluate=False, evaluate_step=2, initial_evaluate=True)
    assert due(s.eval_due, 10) == [] and not s.initial_eval_due(0)


def test_an_early_sync_is_no_eval_point_unless_the_step_is_one():
    s = sched(10, sync_interval=2, evaluate=True, evaluate_step=2)
    assert not s.eval_due(3, expired=True)  # 3 is no multiple of evaluate_step
    s = sched(10, sync_interval=2, evaluate=True, evaluate_step=2)
    assert s.eval_due(4, expired=True) and s.eval_due(10, expired=True)


@pytest.mark.parametrize("evaluate, initial, step, expect", [
    (True, True, 0, True),
    (True, True, 3, False),  # a resumed run does not evaluate "before training" again
    (True, False, 0, False),
    (False, True, 0, False),
])
def test_initial_eval_only_before_the_first_step(evaluate, initial, step, expect):
    assert sched(evaluate=evaluate, initial_evaluate=initial).initial_eval_due(step) is expect


# ------------------------------------------------------------------------------- checkpoint
@pytest.mark.parametrize("interval", DISABLED)
def test_no_checkpoint_when_disabled_not_even_at_the_end(interval):
    assert due(sched(6, checkpoint_interval=interval).checkpoint_due, 6) == []


def test_checkpoint_every_interval_at_sync_points_and_none_of_its_own_at_the_end():
    s = sched(7, sync_interval=1, checkpoint_interval=3)
    assert due(s.checkpoint_due, 7)[1:] == [3, 6]  # step 7, the last, is no multiple: no checkpoint
    assert sched(6, sync_interval=2, checkpoint_interval=2).checkpoint_due(6)  # the last step when a multiple
    # a checkpoint needs a sync point (only reachable when the recipe rules are bypassed)
    assert not sched(10, sync_interval=4, checkpoint_interval=2).checkpoint_due(2)
    assert sched(10, sync_interval=4, checkpoint_interval=2).checkpoint_due(2, expired=True)


# ------------------------------------------------------------------------------- HF export
@pytest.mark.parametrize("interval", DISABLED)
def test_hf_export_disabled_still_exports_the_last_step(interval):
    assert due(sched(6, hf_interval=interval).hf_export_due, 6) == [6]


def test_hf_export_every_interval_and_at_the_last_step():
    assert due(sched(7, hf_interval=3).hf_export_due, 7)[1:] == [3, 6, 7]
    assert due(sched(6, hf_interval=3).hf_export_due, 6)[1:] == [3, 6]


# ----------------------------------------------------------------------- model_step, share
@pytest.mark.parametrize("interval, expect", [
    (1, [0, 1, 2, 3, 4, 5, 6]),
    (2, [0, 0, 2, 2, 4, 4, 6]),
    (3, [0, 0, 0, 3, 3, 3, 6]),
])
def test_model_step_is_the_last_sync_before_the_step(interval, expect):
    s = sched(7, sync_interval=interval)
    assert [s.model_step(t) for t in range(1, 8)] == expect


@pytest.mark.parametrize("total, count", [(10, 3), (9, 3), (2, 4), (100, 7), (1, 1)])
def test_share_splits_evenly_first_parts_bigger(total, count):
    parts = [share(total, i, count) for i in range(count)]
    assert sum(parts) == total and max(parts) - min(parts) <= 1 and parts == sorted(parts, reverse=True)
    assert parts == [len(range(i, total, count)) for i in range(count)]  # a strided shard's size


# -------------------------------------------------------------- the runners' old expressions
def _old_colocate(cfg: dict, total: int, step: int, evaluator: bool) -> tuple:
    """The decisions as ColocateRunner wrote them before the Schedule (commit 4fc714f)."""
    synced = step % cfg["sync_weights_interval"] == 0 or step == total
    ev = bool(evaluator and synced and (step % cfg["evaluate_step"] == 0 or step == total))
    ck = bool(synced and cfg["checkpoint_interval"] and cfg["checkpoint_interval"] > 0
              and step % cfg["checkpoint_interval"] == 0)
    hf = (cfg["hf_interval"] is not None and cfg["hf_interval"] > 0 and step % cfg["hf_interval"] == 0) \
        or step == total
    return synced, ev, ck, hf


def _old_disaggregated(cfg: dict, total: int, step: int, expired: bool, evaluating: bool) -> tuple:
    """The decisions as TrainSide._coordinate wrote them before the Schedule (commit 4fc714f)."""
    interval = cfg["sync_weights_interval"]
    synced = expired or step % interval == 0 or step == total
    ev = bool(synced and evaluating and (step % cfg["evaluate_step"] == 0 or step == total))
    early = synced and expired and step % interval != 0 and step != total
    ck = bool(synced and cfg["checkpoint_interval"] and cfg["checkpoint_interval"] > 0
              and step % cfg["checkpoint_interval"] == 0)
    hf = (cfg["hf_interval"] is not None and cfg["hf_interval"] > 0 and step % cfg["hf_interval"] == 0) \
        or step == total
    return synced, ev, early, ck, hf


def test_the_schedule_decides_as_both_runners_did():
    # every combination, also those the recipe rules refuse (intervals that are no multiple of
    # sync_weights_interval): the decisions are the same expressions, not just the same on valid recipes
    for interval, total, ev_step, ck, hf, evaluate in itertools.product(
            (1, 2, 3), (1, 5, 6, 12), (1, 2, 3, 4), (None, 0, -1, 1, 2, 3, 4), (None, 0, -1, 1, 2, 3, 5),
            (True, False)):
        cfg = {"sync_weights_interval": interval, "evaluate_step": ev_step, "checkpoint_interval": ck,
               "hf_interval": hf}
        s = Schedule(total_steps=total, sync_interval=interval, evaluate=evaluate, evaluate_step=cfg["evaluate_step"],
                     checkpoint_interval=cfg["checkpoint_interval"], hf_interval=cfg["hf_interval"])
        for step in range(1, total + 1):
            assert (s.sync_due(step), s.eval_due(step), s.checkpoint_due(step), s.hf_export_due(step)) \
                == _old_colocate(cfg, total, step, evaluate), (cfg, total, step)
            for expired in (False, True):
                got = (s.sync_due(step, expired=expired), s.eval_due(step, expired=expired),
                       s.early_sync(step, expired=expired), s.checkpoint_due(step, expired=expired),
                       s.hf_export_due(step))
                assert got == _old_disaggregated(cfg, total, step, expired, evaluate), (cfg, total, step, expired)


# ----------------------------------------------------------------------- from the recipe
@pytest.fixture()
def raw(repo):
    return yaml.safe_load((repo / "recipes" / "quickstart.yaml").read_text())


def test_built_from_the_trainer_section(repo, raw, monkeypatch):
    monkeypatch.chdir(repo)
    raw["trainer"].update(sync_weights_interval=5, evaluate_step=25, checkpoint_interval=50, hf_interval=None)
    rec = validate_recipe(raw, source=str(repo / "recipes" / "quickstart.yaml"))
    s = Schedule.of(rec.trainer, rec.eval, 300)
    assert s == Schedule(total_steps=300, sync_interval=5, evaluate=True, initial_evaluate=True, evaluate_step=25,
                         checkpoint_interval=50, hf_interval=None)
    raw["trainer"]["enable_evaluate"] = False
    rec = validate_recipe(raw, source=str(repo / "recipes" / "quickstart.yaml"))
    assert not Schedule.of(rec.trainer, rec.eval, 300).evaluate


def steps_of(recipe, tokenizer) -> int:
    return total_train_steps(recipe.trainer, recipe.tasks, tokenizer)


def test_total_train_steps_from_steps_or_epochs(repo, raw, monkeypatch):
    monkeypatch.chdir(repo)
    src = str(repo / "recipes" / "quickstart.yaml")
    assert steps_of(validate_recipe(raw, source=src), tokenizer=None) == 300
    raw["trainer"].update(total_train_steps=None, total_epochs=3, train_batch_size=30)  # 100 prompts
    from rlcli.tokenizer import load_tokenizer

    assert steps_of(validate_recipe(raw, source=src), load_tokenizer("builtin:digits")) == 100 // 30 * 3
    raw["trainer"].update(total_epochs=2, train_batch_size=32)  # behaviour 38: 100 prompts -> 6 steps
    assert steps_of(validate_recipe(raw, source=src), load_tokenizer("builtin:digits")) == 6
    raw["trainer"]["total_train_steps"] = 4  # total_train_steps wins over total_epochs
    assert steps_of(validate_recipe(raw, source=src), load_tokenizer("builtin:digits")) == 4
    raw["trainer"]["total_train_steps"] = None
    raw["trainer"].update(train_batch_size=1000, total_epochs=1)
    assert steps_of(validate_recipe(raw, source=src), load_tokenizer("builtin:digits")) == 1  # at least 1
