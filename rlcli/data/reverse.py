"""The multi-token toy task: write a string of digits backwards.

A prompt is ``*`` + the digits + ``=`` (``"*4071="``, a single user message); the answer is the
digits reversed (``"1704"``) and then EOS. The problem space is every string of 2 to 4 digits
(11,100 strings), so answers are 2-4 tokens plus EOS, of varying length. The ``*`` marks where
the string starts: to stop, the model must notice that the next digit to write would be the
marker, which it can only do by reading the prompt, not by counting.

Train and held-out problems are disjoint by construction: a string is held out when a hash of
it falls in the lowest 21 % of the hash range (2,287 strings, 20.6 % of the space), whatever
file it is written to. The held-out file holds every held-out string and no other; the training file
holds only the others: 2,000 rows of 2 digits, 2,000 of 3 and 4,000 of 4, drawn with a seeded
generator. Left to the raw mix (100 times more 4-digit strings than 2-digit ones) a model never
learns where short answers end; with equal shares, some seeds stall for hundreds of steps on the
hardest position (the second digit of a 4-digit string, written third), so 4-digit strings
come twice as often.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from pathlib import Path

from rlcli.fsutil import write_jsonl

TRAIN_FILE, HELDOUT_FILE = "reverse_train.jsonl", "reverse_heldout.jsonl"
ALPHABET = "0123456789"
LENGTHS = (2, 3, 4)
HELDOUT_PERCENT = 21  # a string is held out when its hash modulo 100 is below this
ROWS_PER_LENGTH = {2: 2000, 3: 2000, 4: 4000}


def is_heldout(digits: str) -> bool:
    """Whether ``digits`` belongs to the held-out split (the same answer in every process)."""
    h = int.from_bytes(hashlib.blake2b(digits.encode(), digest_size=8).digest(), "little")
    return h % 100 < HELDOUT_PERCENT


def reverse_row(digits: str) -> dict:
    return {"data_source": "reverse", "prompt": f"*{digits}=", "reward_model": {"ground_truth": digits[::-1]}}


def problems(length: int) -> list[str]:
    return ["".join(t) for t in itertools.product(ALPHABET, repeat=length)]


def reverse_rows(seed: int = 0, rows_per_length: dict[int, int] | None = None) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)`` rows: train ``rows_per_length`` rows of each length (drawn from the train
    split only), held-out every string of the held-out split."""
    rows_per_length = rows_per_length or ROWS_PER_LENGTH
    rng = random.Random(seed)
    train: list[dict] = []
    heldout: list[dict] = []
    for length in LENGTHS:
        pool = [p for p in problems(length) if not is_heldout(p)]
        heldout += [reverse_row(p) for p in problems(length) if is_heldout(p)]
        # every train string of the length once per pass, passes repeated up to the row count
        picks: list[str] = []
        while len(picks) < rows_per_length[length]:
            picks += rng.sample(pool, min(len(pool), rows_per_length[length] - len(picks)))
        train += [reverse_row(p) for p in picks]
    rng.shuffle(train)
    return train, heldout


def write_reverse(out_dir: str | Path, seed: int = 0) -> list[Path]:
    """Write ``reverse_train.jsonl`` and ``reverse_heldout.jsonl`` (disjoint) into ``out_dir``."""
    out = Path(out_dir)
    train, heldout = reverse_rows(seed)
    return [write_jsonl(out / TRAIN_FILE, train), write_jsonl(out / HELDOUT_FILE, heldout)]
