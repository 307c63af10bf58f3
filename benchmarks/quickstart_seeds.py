"""Time `rlcli train recipes/quickstart.yaml` for several seeds and print a Markdown table.

    python benchmarks/quickstart_seeds.py            # seeds 1 2 3, one after the other
    python benchmarks/quickstart_seeds.py --seeds 1 2 3 4 5

Each run is a fresh process on a fresh work dir (as `make quickstart` on a clean clone), timed
wall-clock from process start to exit. The table goes to stdout; paste it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args()
    rlcli = shutil.which("rlcli") or str(Path(sys.executable).parent / "rlcli")
    rows = []
    for seed in args.seeds:
        work = Path(tempfile.mkdtemp(prefix=f"qs-seed{seed}-"))
        t0 = time.perf_counter()
        subprocess.run([rlcli, "train", str(REPO / "recipes" / "quickstart.yaml"), f"trainer.seed={seed}",
                        "--work-dir", str(work), "--quiet"], check=True)
        wall = time.perf_counter() - t0
        metrics = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
        evals = [(m["step"], m["eval/accuracy"]) for m in metrics if "eval/accuracy" in m]
        first90 = next((s for s, a in evals if a >= 0.9), None)
        rows.append((seed, wall, evals[0][1], evals[-1][1], first90))
        shutil.rmtree(work, ignore_errors=True)
        print(f"seed {seed}: {wall:.1f}s, eval {evals[0][1]:.2f} -> {evals[-1][1]:.2f}", file=sys.stderr)
    import torch

    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}; date {time.strftime('%Y-%m-%d')}\n")
    print("| seed | wall time (s) | eval/accuracy step 0 | eval/accuracy last step | first eval step >= 0.9 |")
    print("| --- | --- | --- | --- | --- |")
    for seed, wall, a0, a1, f in rows:
        print(f"| {seed} | {wall:.1f} | {a0:.2f} | {a1:.2f} | {f} |")


if __name__ == "__main__":
    main()
