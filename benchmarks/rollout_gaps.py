"""How much of a colocated rollout is outside the embedded engine's steps (the event loop, agent
loops, judging, round trips between the loop and the engine's worker thread), step by step:

    python benchmarks/rollout_gaps.py --tiny --lengths longtail          # CPU, tiny model, 512 rows
    python benchmarks/rollout_gaps.py --tiny --lengths full --new 256    # CPU, 512 rows of 256 tokens
    python benchmarks/rollout_gaps.py --shape 0.5b --lengths longtail    # one GPU, grpo_step.py's work

Each GRPO step prints the rollout's wall time, the engine's busy time (the sum of its steps' wall
times, which hold the GPU's work) and the difference. The work is ``grpo_step.py``'s (64 prompts ×
8 responses; ``--lengths longtail``: EOS on, geometric lengths of mean 256 cut at 1,024), with
``share_prompts`` on and every other setting the recipe's default; ``--tiny`` runs it on the
CPU with the tiny model and 16-token prompts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpo_step as gs  # noqa: E402


def engine_totals(engine):
    """A function returning the engine's counters summed since this call, whoever pops them."""
    popped: dict[str, float] = {}
    pop = engine.pop_stats

    def counting_pop() -> dict[str, float]:
        out = pop()
        for k, v in out.items():
            popped[k] = popped.get(k, 0.0) + v
        return out

    engine.pop_stats = counting_pop
    return lambda: {k: popped.get(k, 0.0) + engine._stats.get(k, 0.0) for k in set(popped) | set(engine._stats)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.5b", choices=[k for k in gs.SHAPES if k != "tiny"])
    ap.add_argument("--lengths", default="longtail", choices=["full", "longtail"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64, help="prompts a step (8 responses each)")
    ap.add_argument("--new", type=int, help="--lengths full: tokens a response (default grpo_step.py's: 256, --tiny 8)")
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU")
    args = ap.parse_args()
    gs.use_shape(args.shape, args.lengths, args.tiny)
    gs.PROMPTS = args.prompts
    if args.tiny:
        gs.PROMPT_LEN = 16
    if args.new:
        gs.NEW = args.new
    root = Path(tempfile.mkdtemp(prefix="rollout-gaps-"))
    model_dir = gs.prepare_model(root, None)
    data = gs.write_prompts(root / "prompts.jsonl", gs.PROMPTS * (args.steps + 2))
    _, runner = gs.colocate_runner(model_dir, data, root / "work", args.steps, ["train_worker.share_prompts=true"])
    totals = engine_totals(runner.backend.engine)
    produce = runner.manager.produce_batch
    rows = []

    async def timed(*a, **k):
        before, t = totals(), time.perf_counter()
        batch = await produce(*a, **k)
        wall, after = time.perf_counter() - t, totals()
        rows.append((wall, {k: after[k] - before.get(k, 0.0) for k in after}))
        return batch

    runner.manager.produce_batch = timed
    try:
        runner.fit()
    finally:
        runner.close()
    print("| step | rollout s | engine busy s | outside the engine's steps ms | engine steps | generated tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, (wall, s) in enumerate(rows, 1):
        print(f"| {i} | {wall:.3f} | {s['busy_s']:.3f} | {1e3 * (wall - s['busy_s']):.0f} | {s['steps']:.0f} | "
              f"{s['generated_tokens']:.0f} |")


if __name__ == "__main__":
    main()
