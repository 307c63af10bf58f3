"""Time one judging step whose judger hangs, exits or allocates without bound on some samples.

    python benchmarks/judge_faults.py                        # every fault, the default executor
    python benchmarks/judge_faults.py --fault hang --executor thread process --timeout 5
    python benchmarks/judge_faults.py --fault none --samples 800 --executor inline thread process

A "step" is one ``JudgePool.judge_group`` over ``--samples`` responses (default 64: eight
groups of eight) of which ``--bad`` (default 8) trigger the fault; the others are scored at
once (``none``: every sample, to measure what judging costs). Each (fault, executor) pair runs
in a fresh Python process, so a judger that ends its process (``os._exit`` under the ``thread``
executor) is reported as such instead of ending this script. Printed per pair: the step's wall
time and the CPU time the pool's own process spent on it (the best of ``--repeat`` steps), how
many samples were scored and failed, the judge counters, and the peak resident memory of the
process that ran the pool.

``memory`` allocates 64 MiB blocks until it fails; in a process without a memory limit
(``RLIMIT_DATA``) it stops at ``--hog-cap-mb`` (default 1024) per call so that the benchmark
cannot take the machine down, then sleeps (and so times out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time

from rlcli.judgers.base import Judger, JudgerConfig


class FaultJudger(Judger):
    """Scores ``ok`` 1.0; ``hang`` sleeps an hour, ``exit`` calls ``os._exit(1)``, ``memory`` allocates."""

    name = "faulty"
    hog_cap_mb = 1024

    def judge(self, response, label, sample):
        if response == "hang":
            time.sleep(3600)
        elif response == "exit":
            os._exit(1)
        elif response == "memory":
            capped = resource.getrlimit(resource.RLIMIT_DATA)[0] != resource.RLIM_INFINITY
            blocks = []
            while capped or len(blocks) * 64 < self.hog_cap_mb:  # no limit: stop at the cap, then hang
                blocks.append(bytearray(64 << 20))
            time.sleep(3600)
        return 1.0


def one_step(fault: str, executor: str, args: argparse.Namespace) -> dict:
    from rlcli.judging import JudgePool
    from rlcli.types import Sample, Status

    FaultJudger.hog_cap_mb = args.hog_cap_mb
    limit = {} if args.memory_limit_mb is None else {"memory_limit_mb": args.memory_limit_mb}
    pool = JudgePool(FaultJudger(JudgerConfig(timeout_s=args.timeout, **limit)), executor=executor)
    samples, bad = args.samples, args.bad
    mk = lambda i, text: Sample(uid=i, group_id=i // 8, task_name="t", prompt_ids=[1], response=text,  # noqa: E731
                                label="x", status=Status.COMPLETED)

    stride = samples // bad if bad else samples + 1

    async def step() -> tuple[float, float, list]:
        await pool.judge_group([mk(i, "ok") for i in range(samples)])  # warm: workers started
        pool.pop_stats()
        best = (float("inf"), float("inf"), [])
        for _ in range(args.repeat):
            batch = [mk(i, fault if i % stride == 0 and i // stride < bad else "ok") for i in range(samples)]
            t0, c0 = time.perf_counter(), time.process_time()
            await pool.judge_group(batch)
            best = min(best, (time.perf_counter() - t0, time.process_time() - c0, batch), key=lambda b: b[0])
        return best

    try:
        wall, cpu, batch = asyncio.run(step())
        stats = {k: v for k, v in pool.pop_stats().items() if v and k != "judger/time_s"}
    finally:
        pool.close()
    return {"fault": fault, "executor": executor, "step_s": round(wall, 2), "pool_cpu_ms": round(cpu * 1e3),
            "scored": sum(s.reward is not None for s in batch), "failed": sum(s.reward is None for s in batch),
            "errors": sorted({s.error for s in batch if s.error}), "stats": stats,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fault", nargs="+", default=["hang", "exit", "memory"], choices=["hang", "exit", "memory", "none"])
    ap.add_argument("--executor", nargs="+", default=[None], help="inline, thread, process (default: the config's)")
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--bad", type=int, default=8)
    ap.add_argument("--hog-cap-mb", type=int, default=1024)
    ap.add_argument("--memory-limit-mb", type=int, help="the judger config's memory_limit_mb (default: its default)")
    ap.add_argument("--repeat", type=int, default=1, help="steps to time (the fastest is printed)")
    ap.add_argument("--max-seconds", type=float, default=120.0, help="give up on a step after this long")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fault, executor = args.child.split(":")
        print(json.dumps(one_step(fault, executor or None, args)))
        return
    for fault in args.fault:
        for executor in args.executor:
            cmd = [sys.executable, __file__, "--child", f"{fault}:{executor or ''}", "--timeout", str(args.timeout),
                   "--samples", str(args.samples), "--bad", str(0 if fault == "none" else args.bad),
                   "--hog-cap-mb", str(args.hog_cap_mb), "--repeat", str(args.repeat)]
            if args.memory_limit_mb is not None:
                cmd += ["--memory-limit-mb", str(args.memory_limit_mb)]
            t0 = time.perf_counter()
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.max_seconds)
            except subprocess.TimeoutExpired:
                print(json.dumps({"fault": fault, "executor": executor, "unfinished": f"step still running "
                                  f"after {args.max_seconds:g} s (killed)"}))
                continue
            if out.returncode != 0:
                print(json.dumps({"fault": fault, "executor": executor, "died": f"exit code {out.returncode}",
                                  "after_s": round(time.perf_counter() - t0, 2),
                                  "stderr_tail": out.stderr.strip().splitlines()[-1:]}))
            else:
                print(out.stdout.strip())


if __name__ == "__main__":
    main()
