"""The task of ``benchmarks/learning_race.py``: the problems, their splits, the RL rows and the judge.

Task: multi-digit addition with the carries written out, one clause per column, then the answer::

    user:      What is 4857+968?
    assistant: 7+8=15, write 5 carry 1. 5+6+1=12, write 2 carry 1. 8+9+1=18, write 8 carry 1.
               4+0+1=5, write 5. #### 5825<|im_end|>

Each operand has 1..``max_digits`` digits (the digit count drawn uniformly), so answers run from
about 13 to 13 x (max_digits + 1) tokens. The judge is rlcli's own ``gsm8k`` judger (the last
``#### <number>``, compared as a number), for every framework.

Splits are disjoint by construction: the unordered operand pair is hashed (SHA-256, so the split is
the same in every process), and one pair in ``HELDOUT_MOD`` is held out. Supervised warm-up and RL
train only on train pairs; the held-out pairs feed two files, ``valid.jsonl`` (the warm start's
stopping rule) and ``heldout.jsonl`` (the RL runs' evaluation, never seen by any training).

The rest of the race's set-up lives beside this file: the tokenizer in ``race_tokenizer.py``, the
model and its greedy evaluation in ``race_model.py``, the warm start in ``race_warmstart.py``. The
report (time to target, ``race.md``, ``race.png``) is ``race_report.py``.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HELDOUT_MOD = 10
DATA_SOURCE = "race/addition"


@dataclass(frozen=True)
class Size:
    """A model shape plus the task and warm-start settings that go with it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    max_digits: int  # operand digits: 1..max_digits
    max_new_tokens: int  # response budget, SFT answers included (the longest answer fits)
    sft_lr: float
    sft_batch: int
    sft_eval_every: int  # optimizer steps between validation evaluations
    n_valid: int  # held-out problems for the warm start's stopping rule
    n_heldout: int  # held-out problems of the RL evaluation (N)
    n_rl_train: int  # train-split prompts of the RL runs
    bpe_vocab: int


SIZES = {
    # CPU smoke test: checks the code paths, measures nothing
    "tiny": Size(hidden=64, layers=2, heads=4, kv_heads=2, inter=128, max_digits=2, max_new_tokens=48,
                 sft_lr=3e-3, sft_batch=32, sft_eval_every=20, n_valid=16, n_heldout=16, n_rl_train=64,
                 bpe_vocab=320),
    # the GPU model: ~76M parameters (12 x 768, GQA 12/4 heads, head dim 64)
    "small": Size(hidden=768, layers=12, heads=12, kv_heads=4, inter=2048, max_digits=5, max_new_tokens=112,
                  sft_lr=5e-4, sft_batch=128, sft_eval_every=25, n_valid=256, n_heldout=256, n_rl_train=8192,
                  bpe_vocab=384),
}


def question(a: int, b: int) -> str:
    return f"What is {a}+{b}?"


def prompt_text(a: int, b: int) -> str:
    return f"<|im_start|>user\n{question(a, b)}<|im_end|>\n<|im_start|>assistant\n"


def solution(a: int, b: int) -> str:
    """The worked answer: one clause per column from the right, then ``#### a+b``."""
    ra, rb = str(a)[::-1], str(b)[::-1]
    parts, carry = [], 0
    for i in range(max(len(ra), len(rb))):
        x = int(ra[i]) if i < len(ra) else 0
        y = int(rb[i]) if i < len(rb) else 0
        s = x + y + carry
        lhs = f"{x}+{y}+{carry}" if carry else f"{x}+{y}"
        carry = s // 10
        parts.append(f"{lhs}={s}, write {s % 10}" + (" carry 1." if carry else "."))
    if carry:
        parts.append("write the final carry 1.")
    return " ".join(parts) + f" #### {a + b}"


def is_heldout(a: int, b: int) -> bool:
    """One unordered operand pair in HELDOUT_MOD is held out (the same answer in every process)."""
    key = f"{min(a, b)}+{max(a, b)}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % HELDOUT_MOD == 0


def draw_pair(rng: random.Random, max_digits: int) -> tuple[int, int]:
    def operand() -> int:
        d = rng.randint(1, max_digits)
        return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)

    return operand(), operand()


def draw_pairs(rng: random.Random, n: int, max_digits: int, heldout: bool,
               exclude: set | None = None) -> list[tuple[int, int]]:
    """``n`` distinct pairs of one split (``heldout``), none in ``exclude``."""
    seen = set(exclude or ())
    out: list[tuple[int, int]] = []
    for _ in range(1000 * n + 1000):
        if len(out) == n:
            return out
        p = draw_pair(rng, max_digits)
        if is_heldout(*p) == heldout and p not in seen:
            seen.add(p)
            out.append(p)
    raise RuntimeError(f"could not draw {n} distinct {'held-out' if heldout else 'train'} pairs "
                       f"with {max_digits} digits")


def draw_pair_train(rng: random.Random, size: Size) -> tuple[int, int]:
    while True:
        p = draw_pair(rng, size.max_digits)
        if not is_heldout(*p):
            return p


def rl_row(a: int, b: int) -> dict[str, Any]:
    """One RL JSONL row (rlcli's ``jsonl`` sampler format; TRL reads the same file)."""
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": question(a, b)}],
            "reward_model": {"ground_truth": str(a + b)}, "extra_info": {"a": a, "b": b}}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def judge(text: str, label: str) -> float:
    """rlcli's ``gsm8k`` judger with its defaults: the score every framework's reward and eval use."""
    from rlcli.judgers.gsm8k import GSM8KJudger

    return float(GSM8KJudger(GSM8KJudger.Config()).judge(text, label, None)["score"])
