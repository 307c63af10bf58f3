"""Read what a run wrote to its work dir, tolerating a run that is still going (or died).

A run writes ``metrics.jsonl`` line by line, ``resolved.yaml`` at start, and
``rollouts/step-N.jsonl`` / ``eval/step-N.jsonl`` atomically (tmp + rename). So a reader can meet
a torn last line in ``metrics.jsonl`` (the writer is mid-line, or was killed), files that do not
exist yet, or a ``.tmp`` file next to the real ones. Every reader here skips what it cannot parse
and records a human-readable note in :attr:`Run.notes` instead of raising.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_STEP_FILE = re.compile(r"^step-(\d+)\.jsonl$")
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "infinity": math.inf, "-infinity": -math.inf}


class ReportError(Exception):
    """A work dir that cannot be reported on at all (nothing an rlcli run writes is there)."""


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int, bool]:
    """``(rows, bad_lines, torn_last)``: the JSON objects of ``path``, skipping lines that do not parse.

    ``torn_last`` is true when the last non-empty line is unreadable: the usual state of a file that
    a writer is appending to (or that a killed writer left mid-line).
    """
    try:
        data = path.read_bytes()
    except OSError:
        return [], 0, False
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    rows: list[dict[str, Any]] = []
    bad = 0
    last_bad = False
    for line in lines:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            last_bad = True
            continue
        # A complete object with no newline yet is still a complete object: keep it.
        if isinstance(obj, dict):
            rows.append(obj)
            last_bad = False
        else:
            bad += 1
            last_bad = True
    return rows, bad, last_bad


def step_files(folder: Path) -> dict[int, Path]:
    """``{step: path}`` of ``folder/step-N.jsonl`` (``.tmp`` leftovers and other names ignored)."""
    out: dict[int, Path] = {}
    if not folder.is_dir():
        return out
    for p in folder.iterdir():
        m = _STEP_FILE.match(p.name)
        if m and p.is_file():
            out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def to_float(v: Any) -> float | None:
    """A metric value as a float: numbers, bools, and the ``"nan"``/``"inf"`` strings the JSONL tracker writes."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        return _NONFINITE.get(v.strip().lower())
    return None


@dataclass
class Run:
    """One work dir, read once: per-step metrics as columns, the resolved recipe, and where samples are."""

    path: Path
    label: str = ""
    rows: list[dict[str, Any]] = field(default_factory=list)
    columns: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    resolved: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    metrics_state: str = "missing"  # missing | empty | ok
    resolved_state: str = "missing"  # missing | unreadable | ok
    eval_files: dict[int, Path] = field(default_factory=dict)
    rollout_files: dict[int, Path] = field(default_factory=dict)

    # ------------------------------------------------------------------ metrics
    def has(self, key: str) -> bool:
        return key in self.columns

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of one metric over the steps that logged it (non-numeric values dropped)."""
        return self.columns.get(key, ([], []))

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self.columns if k.startswith(prefix))

    @property
    def steps(self) -> list[int]:
        return [int(r["step"]) for r in self.rows]

    @property
    def last_step(self) -> int | None:
        return self.rows[-1]["step"] if self.rows else None

    def last(self, key: str) -> float | None:
        s, v = self.series(key)
        return v[-1] if v else None

    # ------------------------------------------------------------------ recipe
    @property
    def recipe(self) -> dict[str, Any]:
        rec = (self.resolved or {}).get("recipe")
        return rec if isinstance(rec, dict) else {}

    @property
    def description(self) -> str:
        d = self.recipe.get("description")
        return str(d).strip() if d else ""

    @property
    def total_steps(self) -> int | None:
        t = (self.recipe.get("trainer") or {}).get("total_train_steps")
        return int(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None

    @property
    def wall_time_s(self) -> float | None:
        """Seconds spent in the logged steps: the sum of ``timing/step_s`` (step 0: its eval), so that
        the idle time between the runs of a resumed job does not count; a run that logged no step
        time: its last ``time`` minus its first."""
        if self.has("timing/step_s"):
            return sum(v for r in self.rows for v in [to_float(r.get("timing/step_s", r.get("timing/eval_s")))]
                       if v is not None and math.isfinite(v))
        s, t = self.series("time")
        return t[-1] - t[0] if len(t) >= 2 else None

    def status(self) -> str:
        """``finished``, ``in progress or stopped`` (with how far it got), or ``not started``."""
        last = self.last_step
        if last is None:
            return "no steps logged yet"
        total = self.total_steps
        if total is not None and last >= total:
            return "finished"
        if total is not None:
            return f"in progress or stopped at step {last} of {total}"
        return f"at step {last} (total unknown)"

    # ------------------------------------------------------------------ samples
    def read_eval(self, step: int) -> list[dict[str, Any]]:
        return _read_samples(self.eval_files.get(step))

    def read_rollouts(self, step: int) -> list[dict[str, Any]]:
        return _read_samples(self.rollout_files.get(step))


def _read_samples(path: Path | None) -> list[dict[str, Any]]:
    if path is None:
        return []
    rows, _, _ = read_jsonl(path)
    return rows


def _columns(rows: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    cols: dict[str, tuple[list[int], list[float]]] = {}
    for r in rows:
        step = r["step"]
        for k, v in r.items():
            if k == "step":
                continue
            f = to_float(v)
            if f is None:
                continue
            c = cols.get(k)
            if c is None:
                c = cols[k] = ([], [])
            c[0].append(step)
            c[1].append(f)
    return cols


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Read one work dir. Raises :class:`ReportError` only when none of a run's outputs are there."""
    import yaml

    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{path}: not a directory")
    run = Run(path=path, label=label or path.resolve().name)
    metrics = path / "metrics.jsonl"
    if metrics.is_file():
        raw, bad, torn = read_jsonl(metrics)
        by_step: dict[int, dict[str, Any]] = {}
        for r in raw:
            step = r.get("step")
            if isinstance(step, bool) or not isinstance(step, (int, float)):
                bad += 1
                continue
            # A resumed run that was not truncated logs a step twice: the later row wins.
            by_step[int(step)] = {**r, "step": int(step)}
        run.rows = [by_step[s] for s in sorted(by_step)]
        run.columns = _columns(run.rows)
        run.metrics_state = "ok" if run.rows else "empty"
        if torn:
            run.notes.append("metrics.jsonl ends in a partial line (the run is writing it, or was killed mid-line); "
                             "it was skipped")
            bad -= 1
        if bad > 0:
            run.notes.append(f"metrics.jsonl: skipped {bad} unreadable line(s)")
        if not run.rows:
            run.notes.append("metrics.jsonl has no complete step yet")
    else:
        run.notes.append("metrics.jsonl is missing (no step has been logged yet?)")
    resolved = path / "resolved.yaml"
    if resolved.is_file():
        try:
            data = yaml.safe_load(resolved.read_text(encoding="utf-8"))
            if isinstance(data, dict):
                run.resolved, run.resolved_state = data, "ok"
            else:
                run.resolved_state = "unreadable"
                run.notes.append("resolved.yaml is not a mapping")
        except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
            run.resolved_state = "unreadable"
            run.notes.append(f"resolved.yaml is unreadable: {str(exc).splitlines()[0]}")
    else:
        run.notes.append("resolved.yaml is missing")
    run.eval_files = step_files(path / "eval")
    run.rollout_files = step_files(path / "rollouts")
    if (run.metrics_state == "missing" and run.resolved_state == "missing" and not run.eval_files
            and not run.rollout_files):
        raise ReportError(f"{path}: not an rlcli work dir (no metrics.jsonl, resolved.yaml, rollouts/ or eval/)")
    return run


def load_runs(paths: list[Path]) -> list[Run]:
    """Load several work dirs with distinct legend labels (the dir name, lengthened by parents on clashes)."""
    runs = [load_run(p) for p in paths]
    labels = _distinct_labels([r.path.resolve() for r in runs])
    for r, lab in zip(runs, labels):
        r.label = lab
    return runs


def _distinct_labels(paths: list[Path]) -> list[str]:
    depth = 1
    while True:
        labels = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels) or all(depth >= len(p.parts) for p in paths):
            break
        depth += 1
    seen: dict[str, int] = {}
    out = []
    for lab in labels:  # the same dir given twice: number the repeats
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if seen[lab] == 1 else f"{lab} ({seen[lab]})")
    return out
