"""``rlcli inspect``: browse the rollouts a run dumped to ``WORK_DIR/rollouts/step-N.jsonl``.

The trainer writes, per step, a bounded sample of rollouts (the best and the worst groups by mean
reward; ``trainer.dump_rollout_groups`` of them). This module filters them (step, task, reward
range) and prints them as one ``rich`` table per step, paged when stdout is a terminal, or as one
JSON object per line (``--json``) for scripts.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from rlcli.report.rundata import read_jsonl, step_files

CLIP_CHARS = 300


@dataclass
class Selection:
    rows: list[dict[str, Any]] = field(default_factory=list)   # matching rows, by step then file order
    dumped_steps: list[int] = field(default_factory=list)      # every step with a rollouts file
    scanned: int = 0                                           # rows read (before filtering)
    tasks: set[str] = field(default_factory=set)               # task names seen in the scanned rows
    rewards: tuple[float, float] | None = None                 # reward range of the scanned rows
    unreadable: int = 0                                        # lines that did not parse


def _reward(row: dict[str, Any]) -> float | None:
    v = row.get("reward")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def select_rollouts(work_dir: Path, *, step: int | None = None, task: str | None = None,
                    min_reward: float | None = None, max_reward: float | None = None) -> Selection:
    """The dumped rollouts of ``work_dir`` that pass every given filter (all of them must hold).

    A rollout without a numeric reward (a failed sample) never passes a reward filter.
    """
    files = step_files(Path(work_dir) / "rollouts")
    sel = Selection(dumped_steps=list(files))
    wanted = [step] if step is not None else list(files)
    lo = hi = None
    for s in wanted:
        path = files.get(s)
        if path is None:
            continue
        rows, bad, _ = read_jsonl(path)
        sel.unreadable += bad
        for row in rows:
            sel.scanned += 1
            row.setdefault("step", s)
            name = row.get("task_name")
            if name is not None:
                sel.tasks.add(str(name))
            r = _reward(row)
            if r is not None:
                lo = r if lo is None else min(lo, r)
                hi = r if hi is None else max(hi, r)
            if task is not None and str(name) != task:
                continue
            if min_reward is not None and (r is None or r < min_reward):
                continue
            if max_reward is not None and (r is None or r > max_reward):
                continue
            sel.rows.append(row)
    if lo is not None:
        sel.rewards = (lo, hi)
    return sel


def step_ranges(steps: Iterable[int]) -> str:
    """``[1, 2, 3, 5, 7, 8]`` -> ``"1-3, 5, 7-8"``."""
    out: list[str] = []
    run: list[int] = []
    for s in sorted(set(steps)):
        if run and s == run[-1] + 1:
            run.append(s)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [s]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def _filters_text(step, task, min_reward, max_reward) -> str:
    parts = []
    if step is not None:
        parts.append(f"--step {step}")
    if task is not None:
        parts.append(f"--task {task}")
    if min_reward is not None:
        parts.append(f"--min-reward {min_reward:g}")
    if max_reward is not None:
        parts.append(f"--max-reward {max_reward:g}")
    return " ".join(parts)


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _clip(text: Any, full: bool) -> str:
    s = "" if text is None else text if isinstance(text, str) else json.dumps(text)
    if full or len(s) <= CLIP_CHARS:
        return s
    return s[:CLIP_CHARS] + f"… (+{len(s) - CLIP_CHARS:,} chars; --full shows all)"


def _tables(rows: list[dict[str, Any]], full: bool):
    """One ``rich`` table per step; a rule between groups."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_step.setdefault(row.get("step"), []).append(row)
    multi_task = len({r.get("task_name") for r in rows}) > 1
    for step, group in by_step.items():
        rewards = [x for x in (_reward(r) for r in group) if x is not None]
        mean = f", mean reward {sum(rewards) / len(rewards):.4g}" if rewards else ""
        t = Table(title=f"step {step} · {len(group)} rollout{'s' if len(group) != 1 else ''}{mean}",
                  title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_lines=False,
                  expand=True, header_style="bold")
        t.add_column("group", justify="right", no_wrap=True)
        t.add_column("uid", justify="right", no_wrap=True)
        if multi_task:
            t.add_column("task", no_wrap=True)
        t.add_column("reward", justify="right", no_wrap=True)
        t.add_column("finish", no_wrap=True)
        t.add_column("tokens p/r", justify="right", no_wrap=True)
        t.add_column("stale", justify="right", no_wrap=True)
        t.add_column("prompt", ratio=3, overflow="fold")
        t.add_column("response", ratio=4, overflow="fold")
        t.add_column("label", ratio=1, overflow="fold")
        prev_group = object()
        for i, r in enumerate(group):
            if i and r.get("group_id") != prev_group:
                t.add_section()
            prev_group = r.get("group_id")
            rew = _reward(r)
            style = "green" if rew is not None and rew >= 1 else "red" if rew is None or rew <= 0 else "yellow"
            finish = str(r.get("finish_reason") or r.get("status") or "")
            if r.get("error"):
                finish += f" ({r['error']})"
            cells = [_num(r.get("group_id")), _num(r.get("uid"))]
            if multi_task:
                cells.append(str(r.get("task_name", "")))
            cells += [Text(_num(rew), style=style), Text(finish, style="red" if r.get("error") else ""),
                      f"{_num(r.get('prompt_tokens'))}/{_num(r.get('response_tokens'))}", _num(r.get("staleness")),
                      Text(_clip(r.get("prompt"), full)), Text(_clip(r.get("response"), full)),
                      Text(_clip(r.get("label"), full))]
            t.add_row(*cells)
        yield t


def run_inspect(work_dir: Path, *, step: int | None = None, task: str | None = None,
                min_reward: float | None = None, max_reward: float | None = None, limit: int | None = None,
                as_json: bool = False, full: bool = False) -> int:
    """Print the matching rollouts; returns how many were printed.

    Raises ``click.ClickException`` (exit 1) when the run has no dumped rollouts at all, or the
    filters contradict each other, (exit 2) when ``step`` was not dumped, naming the steps that
    were; prints a note on stderr (exit 0) when nothing matches.
    """
    work_dir = Path(work_dir)
    if limit is not None and limit < 1:
        raise click.ClickException("--limit must be at least 1")
    if min_reward is not None and max_reward is not None and min_reward > max_reward:
        raise click.ClickException(
            f"--min-reward {min_reward:g} is above --max-reward {max_reward:g}: nothing can match")
    roll = work_dir / "rollouts"
    sel = select_rollouts(work_dir, step=step, task=task, min_reward=min_reward, max_reward=max_reward)
    if not sel.dumped_steps:
        why = "does not exist" if not roll.is_dir() else "has no step-N.jsonl files"
        raise click.ClickException(
            f"{roll} {why}: this run dumped no rollouts (is it an rlcli work dir? the trainer writes "
            "rollouts/step-N.jsonl every step when trainer.dump_rollout_groups > 0)")
    if step is not None and step not in sel.dumped_steps:  # a step that does not exist: a user mistake
        missing = click.ClickException(_nothing_matches(sel, step, task, min_reward, max_reward))
        missing.exit_code = 2
        raise missing
    if sel.unreadable:
        click.secho(f"note: skipped {sel.unreadable} unreadable line(s) (a file being written?)", fg="yellow", err=True)
    if not sel.rows:
        click.secho(_nothing_matches(sel, step, task, min_reward, max_reward), fg="yellow", err=True)
        return 0
    total = len(sel.rows)
    rows = sel.rows[:limit] if limit is not None else sel.rows
    if as_json:
        for r in rows:
            click.echo(json.dumps(r, ensure_ascii=False, default=str))
        return len(rows)
    _print_tables(work_dir, sel, rows, total, step, task, min_reward, max_reward, full)
    return len(rows)


def _nothing_matches(sel: Selection, step, task, min_reward, max_reward) -> str:
    filt = _filters_text(step, task, min_reward, max_reward)
    if step is not None and step not in sel.dumped_steps:
        return f"no rollouts were dumped for step {step} (dumped steps: {step_ranges(sel.dumped_steps)})"
    hints = []
    if task is not None and task not in sel.tasks:
        hints.append(f"tasks: {', '.join(sorted(sel.tasks)) or 'none named'}")
    if sel.rewards is not None:
        hints.append(f"rewards range {sel.rewards[0]:g} to {sel.rewards[1]:g}")
    hint = f" ({'; '.join(hints)})" if hints else ""
    where = f"step {step}" if step is not None else f"{len(sel.dumped_steps)} dumped steps"
    return f"no rollouts match {filt} among {sel.scanned} in {where}{hint}"


def _print_tables(work_dir: Path, sel: Selection, rows, total: int, step, task, min_reward, max_reward,
                  full: bool) -> None:
    from rich.console import Console

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=140)  # piped to a file: wider than the 80 columns rich assumes
    filt = _filters_text(step, task, min_reward, max_reward)
    head = (f"{work_dir}: {len(rows)} of {total} matching rollouts" if len(rows) < total
            else f"{work_dir}: {total} matching rollout{'s' if total != 1 else ''}")
    head += f" ({filt})" if filt else ""
    head += f" · scanned {sel.scanned} from steps {step_ranges(sel.dumped_steps if step is None else [step])}"

    def emit() -> None:
        console.print(head, style="bold", highlight=False, markup=False)
        for t in _tables(rows, full):
            console.print(t)
        if len(rows) < total:
            console.print(f"{total - len(rows)} more match; raise --limit or narrow with --step/--task.",
                          style="dim", highlight=False, markup=False)

    if console.is_terminal:
        os.environ.setdefault("LESS", "-FRX")  # like git: colours, and no pager for a screenful
        with console.pager(styles=True):
            emit()
    else:
        emit()
