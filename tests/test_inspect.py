"""`rlcli inspect`: filters, --json, clipping, empty results and bad dirs, through click's runner."""

import json

import pytest
from click.testing import CliRunner

from rlcli.cli import cli
from rlcli.report.inspect import select_rollouts, step_ranges

LONG = "x" * 350 + "TAIL"


def _row(step, uid, group, reward, *, task="arith", prompt=None, response=None, error=None):
    """One dumped rollout, with the fields ``ColocateRunner.dump_rollouts`` writes."""
    return {"step": step, "task_name": task, "uid": uid, "group_id": group, "data_source": task,
            "prompt": prompt if prompt is not None else f"p{uid}=", "response": response if response is not None
            else f"r{uid}", "label": "4", "reward": reward,
            "reward_details": None if reward is None else {"score": reward}, "status": "failed" if error else
            "completed", "finish_reason": "stop", "error": error, "prompt_tokens": 4, "response_tokens": 1,
            "staleness": 0}


@pytest.fixture()
def work(tmp_path):
    """Steps 1, 2 and 10; two tasks; rewards 0, 0.5, 1 and one failed sample without reward."""
    roll = tmp_path / "run" / "rollouts"
    roll.mkdir(parents=True)
    steps = {
        1: [_row(1, 100, 10, 1.0), _row(1, 101, 10, 0.0), _row(1, 102, 11, 0.5, task="gsm8k")],
        2: [_row(2, 200, 20, 1.0, task="gsm8k"), _row(2, 201, 20, None, error="judge timeout"),
            _row(2, 202, 21, 0.0, response=LONG)],
        10: [_row(10, 1000, 30, 1.0), _row(10, 1001, 30, 0.0), _row(10, 1002, 31, 1.0, prompt="[bold]9+9=[/bold]"),
             _row(10, 1003, 31, 0.5)],
    }
    for s, rows in steps.items():
        (roll / f"step-{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (roll / "step-3.jsonl.tmp").write_text("not json, a write in progress\n")  # must be ignored
    return tmp_path / "run"


def invoke(*args):
    # a fixed, wide terminal: the header holds the run's path, whose length depends on where
    # pytest puts tmp_path (longer under pytest-xdist), and a wrapped line splits the phrases checked below
    return CliRunner().invoke(cli, ["inspect", *map(str, args)], env={"COLUMNS": "200"})


def uids(result):
    return [json.loads(line)["uid"] for line in result.stdout.splitlines()]


def test_step_and_min_reward_lists_only_matching_rollouts_of_that_step(work):
    out = invoke(work, "--min-reward", 1, "--step", 10, "--json")
    assert out.exit_code == 0, out.output
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["uid"] for r in rows] == [1000, 1002]
    assert all(r["step"] == 10 and r["reward"] >= 1 for r in rows)
    assert set(rows[0]) >= {"prompt", "response", "reward_details", "finish_reason", "staleness", "prompt_tokens"}

    table = invoke(work, "--min-reward", 1, "--step", 10)
    assert table.exit_code == 0, table.output
    assert "step 10" in table.stdout and "2 matching rollouts" in table.stdout
    assert "1000" in table.stdout and "1002" in table.stdout
    assert "1001" not in table.stdout and "1003" not in table.stdout and "step 1 " not in table.stdout
    assert "[bold]9+9=[/bold]" in table.stdout  # text is shown as written, never as rich markup


@pytest.mark.parametrize("args, expect", [
    ((), [100, 101, 102, 200, 201, 202, 1000, 1001, 1002, 1003]),
    (("--task", "gsm8k"), [102, 200]),
    (("--max-reward", 0), [101, 202, 1001]),
    (("--min-reward", 0.25, "--max-reward", 0.75), [102, 1003]),
    (("--min-reward", 0), [100, 101, 102, 200, 202, 1000, 1001, 1002, 1003]),  # the failed sample has no reward
    (("--step", 2, "--task", "arith"), [201, 202]),
    (("--limit", 3), [100, 101, 102]),
])
def test_filters(work, args, expect):
    out = invoke(work, *args, "--json")
    assert out.exit_code == 0, out.output
    assert uids(out) == expect


def test_limit_in_table_says_how_many_more(work):
    out = invoke(work, "--limit", 2)
    assert out.exit_code == 0, out.output
    assert "2 of 10 matching rollouts" in out.stdout and "8 more match" in out.stdout
    assert "p100=" in out.stdout and "p102=" not in out.stdout


def test_long_text_is_clipped_unless_full(work):
    clipped = invoke(work, "--step", 2)
    assert clipped.exit_code == 0, clipped.output
    assert "TAIL" not in clipped.stdout and "--full shows all" in clipped.stdout
    whole = invoke(work, "--step", 2, "--full")
    assert "TAIL" in whole.stdout.replace("\n", "").replace(" ", "")
    assert "judge timeout" in whole.stdout  # a failed sample shows its error


def test_nothing_matches_says_why(work):
    out = invoke(work, "--step", 10, "--min-reward", 5)
    assert out.exit_code == 0
    assert out.stdout == ""
    assert "no rollouts match --step 10 --min-reward 5" in out.stderr and "rewards range 0 to 1" in out.stderr

    out = invoke(work, "--task", "nope", "--json")
    assert out.exit_code == 0 and out.stdout == ""
    assert "tasks: arith, gsm8k" in out.stderr


def test_step_that_was_not_dumped(work):
    out = invoke(work, "--step", 7)
    assert out.exit_code == 2 and out.stdout == ""
    assert "no rollouts were dumped for step 7 (dumped steps: 1-2, 10)" in out.stderr


def test_bad_dirs(tmp_path, work):
    missing = invoke(tmp_path / "nope")
    assert missing.exit_code == 2 and "does not exist" in missing.output

    empty = tmp_path / "empty"
    empty.mkdir()
    out = invoke(empty)
    assert out.exit_code == 1 and "rollouts does not exist" in out.stderr

    (empty / "rollouts").mkdir()
    out = invoke(empty, "--json")
    assert out.exit_code == 1 and "has no step-N.jsonl files" in out.stderr and out.stdout == ""

    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert invoke(a_file).exit_code == 2


def test_contradicting_reward_range_and_bad_limit(work):
    out = invoke(work, "--min-reward", 1, "--max-reward", 0)
    assert out.exit_code == 1 and "nothing can match" in out.stderr
    assert invoke(work, "--limit", 0).exit_code == 2


def test_torn_line_of_a_file_being_written_is_skipped_with_a_note(work):
    with (work / "rollouts" / "step-10.jsonl").open("a") as f:
        f.write('{"step": 10, "uid": 9999, "rew')
    out = invoke(work, "--step", 10, "--json")
    assert out.exit_code == 0, out.output
    assert uids(out) == [1000, 1001, 1002, 1003]
    assert "skipped 1 unreadable line" in out.stderr


def test_select_rollouts_and_step_ranges(work):
    sel = select_rollouts(work, min_reward=1)
    assert sel.dumped_steps == [1, 2, 10] and sel.scanned == 10
    assert [r["uid"] for r in sel.rows] == [100, 200, 1000, 1002]
    assert sel.tasks == {"arith", "gsm8k"} and sel.rewards == (0.0, 1.0)
    assert step_ranges([5, 1, 2, 3, 9, 10, 12]) == "1-3, 5, 9-10, 12"
    assert step_ranges([]) == ""
