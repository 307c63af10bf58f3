"""Time a CPU recipe for several seeds and print a Markdown table of its held-out learning.

    python benchmarks/quickstart_seeds.py                                    # quickstart.yaml, seeds 1 2 3
    python benchmarks/quickstart_seeds.py --recipe recipes/quickstart-multitoken.yaml --target 0.8
    python benchmarks/quickstart_seeds.py --seeds 1 2 3 4 5 --set trainer.total_train_steps=400

Each run is a fresh process on a fresh work dir (as `make quickstart` on a clean clone), timed
wall-clock from process start to exit. The table goes to stdout (paste it into
docs/benchmarks.md); ``--json FILE`` also writes the rows. The exit status is 1 when a seed
misses ``--target`` (held-out accuracy at the last evaluation) or ``--max-seconds``, so CI can
run it as a learning check.
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


def run_seed(rlcli: str, recipe: Path, seed: int, overrides: list[str], target: float) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"seed{seed}-"))
    t0 = time.perf_counter()
    try:
        subprocess.run([rlcli, "train", str(recipe), f"trainer.seed={seed}", *overrides, "--work-dir", str(work),
                        "--quiet"], check=True)
        wall = time.perf_counter() - t0
        metrics = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    evals = [(m["step"], m["eval/accuracy"]) for m in metrics if "eval/accuracy" in m]
    gaps = [m["mismatch/logprob_abs_diff"] for m in metrics if "mismatch/logprob_abs_diff" in m]
    return {"seed": seed, "wall_s": round(wall, 1), "acc_first": evals[0][1], "acc_last": evals[-1][1],
            "acc_best": max(a for _, a in evals), "steps": metrics[-1]["step"],
            "first_step_at_target": next((s for s, a in evals if a >= target), None),
            "mismatch_mean": (sum(gaps) / len(gaps)) if gaps else None,
            "mismatch_max": max((m.get("mismatch/logprob_abs_diff_max", 0.0) for m in metrics), default=None)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "quickstart.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--target", type=float, default=0.9, help="held-out accuracy a seed must reach (last eval)")
    ap.add_argument("--max-seconds", type=float, default=None, help="wall time a seed must stay within")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rlcli = shutil.which("rlcli") or str(Path(sys.executable).parent / "rlcli")
    rows = []
    for seed in args.seeds:
        row = run_seed(rlcli, args.recipe, seed, args.overrides, args.target)
        rows.append(row)
        print(f"seed {seed}: {row['wall_s']}s, eval {row['acc_first']:.3f} -> {row['acc_last']:.3f}", file=sys.stderr)
    import torch

    print(f"Recipe: `{args.recipe.relative_to(REPO) if args.recipe.is_relative_to(REPO) else args.recipe}`"
          f"{' ' + ' '.join(args.overrides) if args.overrides else ''}. Machine: {platform.machine()}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}; "
          f"date {time.strftime('%Y-%m-%d')}\n")
    print(f"| seed | wall time (s) | held-out accuracy, first eval | last eval | best | first step >= {args.target} "
          "| engine-trainer gap, mean / max |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        gap = (f"{r['mismatch_mean']:.1e} / {r['mismatch_max']:.1e}" if r["mismatch_mean"] is not None else "-")
        print(f"| {r['seed']} | {r['wall_s']:.1f} | {r['acc_first']:.3f} | {r['acc_last']:.3f} | {r['acc_best']:.3f} "
              f"| {r['first_step_at_target']} | {gap} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    missed = [r["seed"] for r in rows if r["acc_last"] < args.target
              or (args.max_seconds is not None and r["wall_s"] > args.max_seconds)]
    if missed:
        print(f"seeds missing the target {args.target} (or --max-seconds): {missed}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
