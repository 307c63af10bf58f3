"""The ``wandb`` tracker: a Weights & Biases run (``pip install 'rlcli[wandb]'``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from rlcli.component import ComponentConfig
from rlcli.trackers.hosted import TRACKERS_DIR, HostedTracker, cell


class WandbConfig(ComponentConfig):
    project: str | None = Field(None, description="W&B project; default: $WANDB_PROJECT, else wandb's default.")
    entity: str | None = Field(None, description="W&B entity (user or team); default: $WANDB_ENTITY, else yours.")
    run_name: str | None = Field(None, description="Run name; default: the work dir's name.")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="online, offline (sync later with `wandb sync`) or disabled; default: $WANDB_MODE, else "
        "online.")
    dir: str | None = Field(None, description=f"Where wandb writes its run files; default: <work_dir>/{TRACKERS_DIR}.")
    tags: list[str] = Field(default_factory=list, description="Run tags.")


class WandbTracker(HostedTracker):
    """A Weights & Biases run (pip install 'rlcli[wandb]'): every metrics row, the recipe, a samples table.

    Every metrics.jsonl row (same keys, same step); the resolved recipe as the run config and as
    the run file resolved.yaml; the logged rollouts as a table ``samples`` at their step."""

    name: ClassVar[str] = "wandb"
    library: ClassVar[str] = "wandb"
    extra: ClassVar[str] = "wandb"
    Config: ClassVar[type[ComponentConfig]] = WandbConfig

    def _start(self, resume_id: str | None) -> str:
        import wandb

        c = self.config
        run_dir = c.dir or str(self.local_dir)
        self.local_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=c.project, entity=c.entity, name=c.run_name or self.work_dir.resolve().name, mode=c.mode,
            dir=run_dir, tags=c.tags or None, config=self._recipe, id=resume_id,
            resume="allow" if resume_id else None, reinit="create_new")
        if resume_id:
            self._run.config.update(self._recipe, allow_val_change=True)
        if self._recipe_path is not None and self._recipe_path.exists():
            self._run.save(str(self._recipe_path), base_path=str(self._recipe_path.parent), policy="now")
        return self._run.id

    def _send(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def _send_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        columns = ["step", *dict.fromkeys(k for r in rows for k in r)]  # tasks may differ (multi_turn: tool_turns)
        table = wandb.Table(columns=columns, allow_mixed_types=True,
                            data=[[step, *(cell(r.get(k)) for k in columns[1:])] for r in rows])
        self._run.log({"samples": table}, step=step)

    def _finish(self) -> None:
        self._run.finish()
