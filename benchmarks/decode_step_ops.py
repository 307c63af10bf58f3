"""Operator calls the embedded engine launches per decode step outside the decoder forward.

    python benchmarks/decode_step_ops.py            # compile on (the CUDA default), on this machine's CPU
    python benchmarks/decode_step_ops.py --eager

On a GPU each operator call outside the captured decode graph is one kernel launch from the
host, so this count is what a decode step costs the host in sampling and bookkeeping. It runs a
tiny random-init qwen2 model with 512 rows of plain sampling (temperature 0.9, the common RL case),
takes three steps to warm up (and compile), then profiles one step and counts the operator calls
made inside ``EmbeddedEngine._sample_and_record`` (a compiled region counts once; views do not
count). Prints ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rlcli.backends.base import GenerateRequest  # noqa: E402
from rlcli.backends.embedded import EmbeddedBackend  # noqa: E402
from rlcli.testing.backend_conformance import default_context, make_tiny_model_dirs  # noqa: E402
from rlcli.types import SampleParams  # noqa: E402

VIEWS = {"aten::slice", "aten::select", "aten::view", "aten::unsqueeze", "aten::squeeze", "aten::reshape",
         "aten::expand", "aten::as_strided", "aten::alias", "aten::detach", "aten::_unsafe_view", "aten::t",
         "aten::transpose", "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::resolve_conj",
         "aten::resolve_neg"}
MARK = "rlcli::sample_and_record"


def count(compile: bool, rows: int = 512) -> dict:
    model_dir = make_tiny_model_dirs(tempfile.mkdtemp(prefix="ops-"), arch="qwen2", seed=1)[0]
    be = EmbeddedBackend(EmbeddedBackend.Config(max_batch_size=rows, compile=compile), default_context(model_dir))
    eng = be.engine
    params = SampleParams(max_tokens=20, ignore_eos=True, temperature=0.9)
    for i in range(rows):
        eng.submit(eng.make_sequence(GenerateRequest([5 + i % 40, 7, 9], params), i))
    for _ in range(3):
        eng.step()
    inner = eng._sample_and_record

    def marked(*args, **kwargs):
        with torch.profiler.record_function(MARK):
            return inner(*args, **kwargs)

    eng._sample_and_record = marked
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eng.step()
    be.shutdown()

    def directly_under_mark(event) -> bool:  # the outermost operator calls inside the marked region
        parent = event.cpu_parent
        while parent is not None:
            if parent.name == MARK:
                return True
            if parent.name.startswith("aten::") or "Compiled" in parent.name:
                return False
            parent = parent.cpu_parent
        return False

    calls = [e.name for e in prof.events()
             if (e.name.startswith("aten::") or "Compiled" in e.name) and e.name not in VIEWS and directly_under_mark(e)]
    return {"compile": compile, "rows": rows, "ops_per_step": len(calls),
            "by_op": dict(collections.Counter(calls).most_common()), "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eager", action="store_true", help="without torch.compile (the CPU default)")
    args = ap.parse_args()
    print("RESULT " + json.dumps(count(compile=not args.eager)), flush=True)


if __name__ == "__main__":
    main()
