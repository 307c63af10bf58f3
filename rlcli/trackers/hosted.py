"""What the ``wandb`` and ``mlflow`` trackers share: a run of an outside tracking library that
receives every metrics row, the resolved recipe and the sample rows.

* The library is imported only when the run starts (the first row); ``rlcli validate`` checks that
  it is installed and names the extra that installs it.
* The run starts at the first row, after a resume has called ``truncate_after``: a resumed rlcli
  run continues the tracker run of the interrupted one. ``<work_dir>/trackers/<name>.json`` keeps
  that run's id and the last step it received; rows up to that step are not sent again (the
  service already holds them, equal to the rows the resumed run computes but for wall times).
* A failure of the library while logging stops this tracker only (the runner warns once and
  drops it); closing never raises.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from pathlib import Path
from typing import Any, ClassVar

from rlcli.fsutil import write_text
from rlcli.trackers import Tracker

log = logging.getLogger(__name__)

TRACKERS_DIR = "trackers"  # <work_dir>/trackers/: run state, and the default local stores


class HostedTracker(Tracker):
    """Base of trackers that log to a run of an outside library (``library``, installed by the
    ``rlcli[<extra>]`` extra). Subclasses implement :meth:`_start`, :meth:`_send`,
    :meth:`_send_samples` and :meth:`_finish`."""

    library: ClassVar[str] = ""
    extra: ClassVar[str] = ""

    @classmethod
    def check_config(cls, cfg: Any) -> list[tuple[str, str]]:
        """``rlcli validate``: the library must be importable (before any model is loaded)."""
        if importlib.util.find_spec(cls.library) is None:
            return [("name", (f"tracker {cls.name!r} needs the {cls.library!r} package, which is not installed; "
                              f"install it with: pip install 'rlcli[{cls.extra}]'"))]
        return []

    def __init__(self, config=None, *, work_dir):
        super().__init__(config, work_dir=work_dir)
        self.local_dir = self.work_dir / TRACKERS_DIR
        self._state_path = self.local_dir / f"{self.name}.json"
        self._recipe: dict[str, Any] = {}
        self._recipe_path: Path | None = None
        self._resuming = False
        self._run_id: str | None = None
        self._sent_through = -1  # rows up to this step are in the run already (an interrupted attempt's)

    # ------------------------------------------------------------------ the runner's calls
    def log_recipe(self, recipe: dict[str, Any], path: Path) -> None:
        self._recipe, self._recipe_path = recipe, path

    def truncate_after(self, step: int) -> None:
        self._resuming = self._run_id is None  # before the first row: continue the saved run

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._ensure_run()
        if step <= self._sent_through:
            return
        self._send(step, {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        write_text(self._state_path, json.dumps({"run_id": self._run_id, "last_step": step}))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._ensure_run()
        if rows and step > self._sent_through:
            self._send_samples(step, rows)

    def close(self) -> None:
        if self._run_id is None:
            return
        try:
            self._finish()
        except Exception as exc:  # closing a tracker never fails the run
            log.warning("tracker %s failed while closing its run: %s", self.name, exc)

    # ---------------------------------------------------------------------------- shared
    def _ensure_run(self) -> None:
        if self._run_id is not None:
            return
        state = None
        if self._resuming and self._state_path.exists():
            state = json.loads(self._state_path.read_text(encoding="utf-8"))
        self._run_id = self._start(state["run_id"] if state else None)
        self._sent_through = int(state["last_step"]) if state else -1

    def _start(self, resume_id: str | None) -> str:
        """Open a new run (``resume_id`` None) or continue run ``resume_id``; log the recipe; the run's id."""
        raise NotImplementedError

    def _send(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def _send_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


def cell(v: Any) -> Any:
    """A sample field as a table cell: numbers and strings as they are, anything else as JSON."""
    if v is None or isinstance(v, (str, bool, int)) or (isinstance(v, float) and math.isfinite(v)):
        return v
    return json.dumps(v, default=str)


def flat_params(d: Any, prefix: str = "") -> dict[str, str]:
    """A nested recipe as ``{"trainer.seed": "42", "tasks.0.task_name": "math", ...}``."""
    if isinstance(d, dict) and d:
        items = d.items()
    elif isinstance(d, list) and d:
        items = ((str(i), v) for i, v in enumerate(d))
    else:
        return {prefix: json.dumps(d) if isinstance(d, (dict, list)) else str(d)} if prefix else {}
    out: dict[str, str] = {}
    for k, v in items:
        out.update(flat_params(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
