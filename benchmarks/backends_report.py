"""``benchmarks/backends.py``'s markdown: the rows for docs/backends.md (``backends-<engine>.md``)
from the run's ``RESULT`` records: conformance, the GRPO steps, throughput, each check, and the
greedy copies of the copies section."""

from __future__ import annotations

import backends_common as common
from backends_common import GRPO_STEPS


def markdown(engine: str, env: dict) -> str:
    by = {}
    for r in common.RESULTS:
        by.setdefault(r["what"], []).append(r)
    checks = by.get("check", [])
    passed = sum(r["status"] == "pass" for r in checks)
    failed = [r["check"] for r in checks if r["status"] == "FAIL"]
    not_run = [r["check"] for r in checks if r["status"] == "not run"]
    conf = f"{passed}/{len(checks)} pass" if checks else "not run"
    if failed:
        conf += f"; FAIL: {', '.join(failed)}"
    if not_run:
        conf += f"; not run: {', '.join(not_run)}"
    grpo = (by.get("grpo") or [{}])[-1]
    if "steps" in grpo:
        grpo_cell = (f"{grpo['steps']}/{GRPO_STEPS} steps, {'finite' if grpo.get('finite') else 'NOT finite'}, "
                     f"step s {grpo['step_s']}, rollout-vs-train logprob diff "
                     f"{[f'{x:.2g}' for x in grpo.get('rollout_logprob_diff') or [] if x is not None]}")
    else:
        grpo_cell = "not run" if "grpo" not in by else f"error: {str(grpo.get('error', ''))[:120]}"
    thr = (by.get("throughput") or [{}])[-1]
    if "bare_tok_s" in thr:
        paired = f" (per-round median {thr['ratio_paired_median']:.2f})" if "ratio_paired_median" in thr else ""
        if "ratio_paired_quartiles" in thr:
            paired = paired[:-1] + f", quartiles {', '.join(f'{q:.2f}' for q in thr['ratio_paired_quartiles'])})"

        def rate(key: str) -> str:
            return f"{thr[key]:,}" if key in thr else "not run"

        ratio = f"{thr['ratio']:.2f}{paired}" if "ratio" in thr else "-"
        tput = f"{rate('rlcli_tok_s')} | {rate('rlcli_seeded_tok_s')} | {thr['bare_tok_s']:,} | {ratio}"
    else:
        tput = "not run | - | - | -" if "throughput" not in by else "error | - | - | -"
    lines = [
        f"<!-- benchmarks/backends.py --engine {engine}: {env['date']}, {env['device']}, torch {env['torch']}, "
        f"rlcli {env['commit']} -->",
        "| engine | date | device | conformance | 3-step GRPO | tok/s via rlcli | via rlcli, seeded | bare engine | "
        "rlcli / bare |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {env['engine_version']} | {env['date']} | {env['device']} | {conf} | {grpo_cell} | {tput} |",
        "",
    ]
    settings = (by.get("engine_settings") or [{}])[-1].get("settings")
    if settings:
        lines += ["Engine settings after start-up: " + ", ".join(f"`{k}` {v}" for k, v in settings.items()) + ".", ""]
    if "batched_tok_s" in thr:
        lines += [f"Via rlcli with `batch_requests: true`: {thr['batched_tok_s']:,} tok/s, "
                  f"{thr['batched_ratio']:.2f} of bare (per-round median {thr['batched_ratio_paired_median']:.2f}).",
                  ""]
    kernels = {r["path"]: r["summary"] for r in by.get("kernel_profile", []) if "summary" in r}
    if kernels:
        from engine_kernels import markdown as kernel_table

        lines += [f"GPU kernels of one profiled round ({engine}; `engine_kernels.py`):", "", kernel_table(kernels)]
    for r in by.get("kernel_profile", []):
        if "error" in r:
            lines += [f"Kernel profile of {r['path']}: error: {str(r['error']).strip().splitlines()[-1][:150]}", ""]
    lines += [
        "| check | result | detail | by design |",
        "| --- | --- | --- | --- |",
    ]
    for r in checks:
        lines.append(f"| {r['check']} | {r['status']} | {r.get('detail', '').replace('|', '/')} | "
                     f"{r.get('by_design', '')} |")
    if by.get("copies"):
        lines += ["", "Greedy copies (prompts whose copies differ / greedy prompts; most distinct outputs of one "
                  "prompt; earliest position two copies part):", "", "| variant | settings | mixed load | copies alone | one at a time | build s |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in by["copies"]:
            if "error" in r:
                # a section skipped or failed as a whole has no variant of its own
                lines.append(f"| {r.get('variant', 'all')} | {', '.join(r.get('settings', []))} | error: "
                             f"{str(r['error']).strip().splitlines()[-1][:150].replace('|', '/')} | | | |")
                continue
            cell = [f"{r[k]['diverging']} / {r[k]['prompts']}, {r[k]['most_distinct']}, "
                    f"{r[k]['earliest_divergence']}" for k in ("mixed", "alone", "serial")]
            lines.append(f"| {r['variant']} | {', '.join(r['settings'])} | {' | '.join(cell)} | {r['build_s']} |")
    return "\n".join(lines) + "\n"
