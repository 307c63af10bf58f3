"""What the embedded engine's lockstep buys and costs, on this machine (CPU by default):

    python benchmarks/lockstep_cost.py                       # 2 runs each way, 20 steps, 128 groups a step
    python benchmarks/lockstep_cost.py --runs 3 --steps 12 --out results/lockstep
    python benchmarks/lockstep_cost.py --variant sync-dynamic-is

Runs ``rlcli train recipes/quickstart-multitoken.yaml`` (evaluation off) with ``rollout.lockstep``
true and false, ``--runs`` times each, the settings interleaved, in one of two variants:
``async``, the async variant of the recipe's header (over-sampling 0.5, partial rollout, staleness
1, weights synced every 2 steps, 256 decode slots), or ``sync-dynamic-is``, sync production with
dynamic sampling (``all_equal_rewards``: replacement groups start while others decode) and rollout
IS (the engine's logprobs reach the loss). Reported per setting: each run's wall time, the median of its ``timing/rollout_s``
from the third step on, and whether all its runs logged the same metrics (wall-clock keys aside) -
the reproducibility lockstep is there for (docs/async.md, "Reproducibility").

Output: a markdown table and a ``RESULT {json}`` line; ``--out DIR`` also gets ``lockstep-cost.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASYNC_VARIANT = ["tasks.0.produce_strategy={name: async, over_sample_threshold: 0.5, enable_partial_rollout: true, "
                 "max_staleness: 1}", "replay_buffer.name=async", "trainer.sync_weights_interval=2",
                 "rollout.max_batch_size=256"]
VARIANTS = {"async": ASYNC_VARIANT,
            "sync-dynamic-is": ["tasks.0.group_filters=[{name: all_equal_rewards}]",
                                "train_worker.rollout_is={mode: truncate, threshold_upper: 2.0}"]}


def one_run(work: Path, steps: int, groups: int, lockstep: bool, variant: str = "async") -> dict:
    cmd = [sys.executable, "-m", "rlcli.cli", "train", str(REPO / "recipes" / "quickstart-multitoken.yaml"),
           "--work-dir", str(work), "--quiet", f"trainer.total_train_steps={steps}",
           f"trainer.train_batch_size={groups}", "trainer.enable_evaluate=false",
           "trainer.enable_initial_evaluate=false", "trainer.checkpoint_interval=-1", *VARIANTS[variant],
           f"rollout.lockstep={str(lockstep).lower()}"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO))
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"rlcli train failed ({proc.returncode}): {proc.stderr[-2000:]}")
    from rlcli.runner.records import is_wall_time

    rows = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    rollout = [r["timing/rollout_s"] for r in rows if "timing/rollout_s" in r][2:]
    return {"wall_s": round(wall, 2), "rollout_s_median": round(statistics.median(rollout), 4) if rollout else None,
            "metrics": [{k: v for k, v in r.items() if not is_wall_time(k)} for r in rows]}


def measure(runs: int, steps: int, groups: int, variant: str = "async") -> dict:
    out: dict[str, list[dict]] = {"true": [], "false": []}
    with tempfile.TemporaryDirectory(prefix="lockstep-cost-") as tmp:
        for i in range(runs):
            for lockstep in (True, False):  # interleaved: drift of the machine hits both
                out[str(lockstep).lower()].append(one_run(Path(tmp) / f"{lockstep}-{i}", steps, groups, lockstep,
                                                          variant))
    report = {"runs": runs, "steps": steps, "groups": groups, "variant": variant}
    for key, rs in out.items():
        report[f"lockstep_{key}"] = {"wall_s": [r["wall_s"] for r in rs],
                                    "rollout_s_median": [r["rollout_s_median"] for r in rs],
                                    "runs_identical": all(r["metrics"] == rs[0]["metrics"] for r in rs[1:])}
    return report


def markdown(r: dict) -> str:
    lines = [f"quickstart-multitoken, {r.get('variant', 'async')} variant, {r['groups']} groups a step, "
             f"{r['steps']} steps, "
             f"{r['runs']} runs each way", "",
             "| rollout.lockstep | wall s | rollout s (median from step 3) | runs identical |", "| --- | --- | --- | --- |"]
    for key in ("true", "false"):
        x = r[f"lockstep_{key}"]
        lines.append(f"| {key} | {', '.join(map(str, x['wall_s']))} | {', '.join(map(str, x['rollout_s_median']))} | "
                     f"{'yes' if x['runs_identical'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="runs of each setting (2 or more to compare them)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--groups", type=int, default=128, help="trainer.train_batch_size")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="async")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.runs < 1 or args.steps < 1 or args.groups < 1:
        ap.error("--runs, --steps and --groups must be positive")
    sys.path.insert(0, str(REPO))
    r = measure(args.runs, args.steps, args.groups, args.variant)
    print(markdown(r), flush=True)
    print("RESULT " + json.dumps(r), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lockstep-cost.json").write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
