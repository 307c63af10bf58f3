"""benchmarks/lockstep_cost.py for real, small: both settings run and are reported, and the
runs in lockstep match each other."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import lockstep_cost  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["async", "sync-dynamic-is"])
def test_both_settings_run_and_lockstep_runs_repeat(tmp_path, capsys, variant):
    assert lockstep_cost.main(["--runs", "2", "--steps", "3", "--groups", "16", "--variant", variant,
                               "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "lockstep-cost.json").read_text())
    for key in ("lockstep_true", "lockstep_false"):
        assert len(r[key]["wall_s"]) == 2 and all(w > 0 for w in r[key]["wall_s"])
        assert all(m > 0 for m in r[key]["rollout_s_median"])  # step 3: the one past the first two
    assert r["lockstep_true"]["runs_identical"] is True
    assert "| true |" in capsys.readouterr().out and r["variant"] == variant
