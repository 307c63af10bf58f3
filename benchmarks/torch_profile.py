"""``profiled``: torch.profiler over one block of ``grpo_step.py`` (``--profile``).

The block's kernel tables (by self time and by total time) are printed and appended to
``profiles.txt``; the block named ``step`` (one whole GRPO step) is also written as a gzipped
Chrome/Perfetto trace, ``trace-step.json.gz`` (``trace_gaps.py`` reads it).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

import torch


def profiled(name: str, out_dir: Path | None, what: str, device: str):
    """Context manager: torch.profiler over the block when ``out_dir`` is given (``--profile``; with
    ``what`` "train", only blocks named train*); writes a kernel table to ``out_dir/profiles.txt``."""
    if out_dir is None or (what == "train" and not name.startswith("train")):
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])

    @contextlib.contextmanager
    def run():
        t = time.perf_counter()
        with profile(activities=acts) as prof:
            yield
            if device == "cuda":
                torch.cuda.synchronize()
        wall = time.perf_counter() - t
        ka = prof.key_averages()
        key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
        busy = sum(getattr(e, key, 0) for e in ka) / 1e6
        head = f"===== {name}: wall {wall:.3f}s, summed self {'GPU' if device == 'cuda' else 'CPU'} time {busy:.3f}s"
        text = "\n".join([head, ka.table(sort_by=key, row_limit=45, max_name_column_width=80),
                          "by total time (ranges include their children):",
                          ka.table(sort_by=key.replace("self_", ""), row_limit=25, max_name_column_width=80)])
        out_dir.mkdir(parents=True, exist_ok=True)
        with (out_dir / "profiles.txt").open("a") as f:
            f.write(text + "\n\n")
        print(text, flush=True)
        if name == "step":  # one whole GRPO step as a Chrome/Perfetto trace, gzipped
            import gzip
            import shutil

            raw = Path(tempfile.mkdtemp()) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(out_dir / "trace-step.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)

    return run()
