"""The ``mlflow`` tracker: an MLflow run (``pip install 'rlcli[mlflow]'``, the ``mlflow-skinny`` client)."""

from __future__ import annotations

import json
import os
import time
from typing import Any, ClassVar

from pydantic import Field

from rlcli.component import ComponentConfig
from rlcli.trackers.hosted import TRACKERS_DIR, HostedTracker, flat_params

# MLflow's REST API takes at most this many metrics, and params, per log_batch call.
_METRICS_PER_CALL, _PARAMS_PER_CALL = 1000, 100
_MAX_PARAM_CHARS = 6000


class MlflowConfig(ComponentConfig):
    tracking_uri: str | None = Field(
        None, description=f"MLflow tracking URI; default: $MLFLOW_TRACKING_URI, else a local file store, "
        f"file:<work_dir>/{TRACKERS_DIR}/mlruns.")
    experiment_name: str | None = Field(
        None, description="Experiment (created when missing); default: $MLFLOW_EXPERIMENT_NAME, else 'rlcli'.")
    run_name: str | None = Field(None, description="Run name; default: the work dir's name.")
    tags: dict[str, str] = Field(default_factory=dict, description="Run tags.")


class MlflowTracker(HostedTracker):
    """An MLflow run (pip install 'rlcli[mlflow]'): every metrics row, the recipe, the samples.

    Every metrics.jsonl row as metrics (same keys, the row's step); the resolved recipe as params
    (dotted keys: ``trainer.seed``) and as the artifact resolved.yaml; the logged rollouts as the
    artifacts samples/step-N.jsonl."""

    name: ClassVar[str] = "mlflow"
    library: ClassVar[str] = "mlflow"
    extra: ClassVar[str] = "mlflow"
    Config: ClassVar[type[ComponentConfig]] = MlflowConfig

    def tracking_uri(self) -> str:
        uri = self.config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        return uri or (self.local_dir / "mlruns").resolve().as_uri()

    def _start(self, resume_id: str | None) -> str:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 refuses its file store unless this is set; a file store is what was asked for
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(tracking_uri=uri)
        if resume_id is None:
            exp_name = self.config.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "rlcli"
            exp = client.get_experiment_by_name(exp_name)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(exp_name)
            tags = {"rlcli.work_dir": str(self.work_dir.resolve()), **self.config.tags}
            run_id = client.create_run(exp_id, run_name=self.config.run_name or self.work_dir.resolve().name,
                                       tags=tags).info.run_id
            params = [Param(k, v[:_MAX_PARAM_CHARS]) for k, v in flat_params(self._recipe).items()]
            for i in range(0, len(params), _PARAMS_PER_CALL):  # params are immutable: only a new run gets them
                client.log_batch(run_id, params=params[i:i + _PARAMS_PER_CALL])
        else:
            run_id = resume_id
            client.update_run(run_id, status="RUNNING")
        if self._recipe_path is not None and self._recipe_path.exists():
            client.log_artifact(run_id, str(self._recipe_path))
        return run_id

    def _send(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        batch = [Metric(k, v, ms, step) for k, v in metrics.items()]
        for i in range(0, len(batch), _METRICS_PER_CALL):
            self._client.log_batch(self._run_id, metrics=batch[i:i + _METRICS_PER_CALL])

    def _send_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps({"step": step, **r}, default=str) + "\n" for r in rows)
        self._client.log_text(self._run_id, text, f"samples/step-{step}.jsonl")

    def _finish(self) -> None:
        self._client.set_terminated(self._run_id)
