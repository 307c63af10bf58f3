"""The tool-use toy task: products of two random 2-3 digit numbers.

A prompt is the bare expression (``"37*482"``, a single user message) and the label its exact product (``"17834"``).
A small model trained from scratch cannot multiply such numbers, and with 1 000 training
problems it cannot memorise them either; it can only get the reward by using the
``calculator`` tool (see ``recipes/tool-calculator.yaml``). Train and test problems are drawn
from one seeded generator and never share an operand pair, so evaluation is on unseen products.
"""

from __future__ import annotations

import random
from pathlib import Path

from rlcli.fsutil import write_jsonl

TRAIN_FILE, TEST_FILE = "tool_arith_train.jsonl", "tool_arith_test.jsonl"


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def tool_arith_rows(n: int, seed: int = 0, min_digits: int = 2, max_digits: int = 3,
                    exclude: set[tuple[int, int]] | None = None) -> list[dict]:
    """``n`` distinct problems ``a*b`` (operands of ``min_digits``..``max_digits`` digits) as RL JSONL rows."""
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    space = (10**max_digits - 10 ** (min_digits - 1)) ** 2
    taken = set(exclude or ())
    if n > space - len(taken):
        raise ValueError(f"cannot draw {n} distinct problems with {min_digits}-{max_digits} digit operands")
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        a, b = _operand(rng, min_digits, max_digits), _operand(rng, min_digits, max_digits)
        if (a, b) in taken:
            continue
        taken.add((a, b))
        rows.append({"data_source": "tool_arith", "prompt": f"{a}*{b}", "reward_model": {"ground_truth": str(a * b)}})
    return rows


def write_tool_arith(out_dir: str | Path, train: int = 1000, test: int = 200, seed: int = 0) -> list[Path]:
    """Write ``tool_arith_train.jsonl`` and ``tool_arith_test.jsonl`` (disjoint) into ``out_dir``."""
    out = Path(out_dir)
    train_rows = tool_arith_rows(train, seed)
    pairs = {tuple(int(x) for x in r["prompt"].split("*")) for r in train_rows}
    test_rows = tool_arith_rows(test, seed + 1, exclude=pairs)
    return [write_jsonl(out / TRAIN_FILE, train_rows), write_jsonl(out / TEST_FILE, test_rows)]
