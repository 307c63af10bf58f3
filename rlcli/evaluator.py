"""Former home of the evaluator metrics, kept so ``rlcli.evaluator.EvaluatorMetric`` and the other
names still import. They live in :mod:`rlcli.evaluator_metrics` (kind ``evaluator_metric``); the
evaluator that runs the eval tasks is the runner's ``Evaluator``."""

from rlcli import evaluator_metrics as _home
from rlcli.evaluator_metrics import *  # noqa: F403

__all__ = list(_home.__all__)
