"""Looking at runs: ``rlcli report`` (one self-contained HTML page) and ``rlcli inspect`` (rollouts in the terminal).

* :mod:`rlcli.report.rundata` reads a work dir (``metrics.jsonl``, ``resolved.yaml``,
  ``rollouts/step-N.jsonl``, ``eval/step-N.jsonl``) tolerantly: a run still in progress may have a
  torn last line or missing files, and the readers say what is missing instead of failing.
* :mod:`rlcli.report.plots` draws the figures with matplotlib's Agg canvas (no display, no pyplot
  global state) and returns them as base64 PNG.
* :mod:`rlcli.report.html` assembles the page: :func:`~rlcli.report.html.write_report`.
* :mod:`rlcli.report.inspect` browses dumped rollouts: :func:`~rlcli.report.inspect.run_inspect`.
"""

from rlcli.report.rundata import ReportError, Run, load_run

__all__ = ["ReportError", "Run", "load_run"]
