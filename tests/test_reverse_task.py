"""The multi-token toy task (recipes/quickstart-multitoken.yaml): its data and its split."""

from __future__ import annotations

import json
from collections import Counter

from click.testing import CliRunner

from rlcli.cli import cli
from rlcli.data.reverse import HELDOUT_FILE, LENGTHS, ROWS_PER_LENGTH, TRAIN_FILE, is_heldout, problems, reverse_rows


def digits_of(row: dict) -> str:
    prompt = row["prompt"]
    assert prompt[0] == "*" and prompt[-1] == "="
    return prompt[1:-1]


def test_train_and_heldout_are_disjoint_by_construction():
    train, heldout = reverse_rows()
    train_digits, heldout_digits = {digits_of(r) for r in train}, {digits_of(r) for r in heldout}
    assert not train_digits & heldout_digits
    space = sum(len(problems(n)) for n in LENGTHS)
    assert len(heldout) == len(heldout_digits) and 0.20 <= len(heldout) / space <= 0.22  # every held-out string
    assert all(is_heldout(d) for d in heldout_digits) and not any(is_heldout(d) for d in train_digits)
    for r in train + heldout:
        assert r["reward_model"]["ground_truth"] == digits_of(r)[::-1]


def test_training_rows_weight_the_lengths_and_cover_the_short_strings():
    train, _ = reverse_rows()
    assert Counter(len(digits_of(r)) for r in train) == ROWS_PER_LENGTH and set(ROWS_PER_LENGTH) == set(LENGTHS)
    short = [p for p in problems(2) if not is_heldout(p)]
    assert {digits_of(r) for r in train if len(digits_of(r)) == 2} == set(short)  # each one, about equally often
    counts = Counter(digits_of(r) for r in train if len(digits_of(r)) == 2)
    assert max(counts.values()) - min(counts.values()) <= 1


def test_the_shipped_files_are_what_the_generator_writes(repo, tmp_path):
    res = CliRunner().invoke(cli, ["data", "reverse", str(tmp_path)])
    assert res.exit_code == 0, res.output
    for name in (TRAIN_FILE, HELDOUT_FILE):
        assert (tmp_path / name).read_text() == (repo / "recipes" / "data" / name).read_text(), name
    row = json.loads((tmp_path / TRAIN_FILE).read_text().splitlines()[0])
    assert set(row) == {"data_source", "prompt", "reward_model"}
