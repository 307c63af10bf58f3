"""Experiment trackers: where per-step scalars and sample texts go.

* ``jsonl``: ``<work_dir>/metrics.jsonl``, one JSON object per step (always enabled).
* ``tensorboard``: event files under ``<work_dir>/tensorboard/``, scalars plus a few rollouts
  as text.
* ``wandb`` and ``mlflow`` (optional extras ``rlcli[wandb]``, ``rlcli[mlflow]``): a run of that
  service with every row, the resolved recipe and the sample rows (:mod:`rlcli.trackers.hosted`).

On resume the runner calls ``truncate_after(step)`` so that a resumed run's logs equal those of
a run that was never interrupted (rows written after the checkpoint are dropped). A tracker
that fails while logging is disabled with a warning; it never stops training.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, ClassVar

from rlcli import hookimpl
from rlcli.component import Component, ComponentConfig
from rlcli.fsutil import write_text

log = logging.getLogger(__name__)


class Tracker(Component):
    """Base class of trackers."""

    def __init__(self, config: ComponentConfig | None = None, *, work_dir: str | Path):
        super().__init__(config)
        self.work_dir = Path(work_dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def log_text(self, step: int, tag: str, text: str) -> None:  # noqa: B027 - optional
        pass

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A few rollouts of the step, one dict per sample (the fields of ``rollouts/step-N.jsonl``:
        ``prompt``, ``response``, ``reward``, ...). Default: each as a ``rollout`` text (:meth:`log_text`)."""
        for r in rows:
            reward = float(r["reward"]) if r.get("reward") is not None else 0.0
            self.log_text(step, "rollout", f"**prompt** {r['prompt']!r}\n\n**response** {r['response']!r}"
                                           f"\n\n**reward** {reward}")

    def log_recipe(self, recipe: dict[str, Any], path: Path) -> None:  # noqa: B027 - optional
        """The run's resolved recipe (the ``recipe`` section of ``path``, ``<work_dir>/resolved.yaml``);
        called once, right after the tracker is built."""

    def truncate_after(self, step: int) -> None:  # noqa: B027 - optional
        pass

    def close(self) -> None:  # noqa: B027 - optional
        pass


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan"/"inf": valid JSON, visible to the reader
    return v


class JsonlTracker(Tracker):
    """One JSON object per step in <work_dir>/metrics.jsonl."""

    name: ClassVar[str] = "jsonl"

    def __init__(self, config=None, *, work_dir):
        super().__init__(config, work_dir=work_dir)
        self.path = self.work_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def truncate_after(self, step: int) -> None:
        self._f.close()
        if self.path.exists():
            kept = []
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line).get("step", 0) <= step:
                        kept.append(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a killed process
            write_text(self.path, "".join(x + "\n" for x in kept))
        self._f = self.path.open("a", encoding="utf-8")

    def close(self) -> None:
        self._f.close()


class TensorBoardTracker(Tracker):
    """TensorBoard event files in <work_dir>/tensorboard/ (scalars and sample rollouts)."""

    name: ClassVar[str] = "tensorboard"

    def __init__(self, config=None, *, work_dir):
        super().__init__(config, work_dir=work_dir)
        self._purge_step: int | None = None
        self._writer = None

    def _w(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.work_dir / "tensorboard"), purge_step=self._purge_step)
        return self._writer

    def log(self, step: int, metrics: dict[str, float]) -> None:
        w = self._w()
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and k != "time":
                w.add_scalar(k, v, step)
        w.flush()

    def log_text(self, step: int, tag: str, text: str) -> None:
        self._w().add_text(tag, text, step)

    def truncate_after(self, step: int) -> None:
        self._purge_step = step + 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


@hookimpl
def register_trackers():
    from rlcli.trackers.mlflow_tracker import MlflowTracker
    from rlcli.trackers.wandb_tracker import WandbTracker

    return [JsonlTracker, TensorBoardTracker, WandbTracker, MlflowTracker]
