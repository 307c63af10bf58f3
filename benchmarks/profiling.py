"""``maybe_profile``: cProfile a block when a directory is given, writing the 40 costliest calls.

Used by the learning race to see where an engine's start-up goes (``RACE_PROFILE=$OUT``). The
profiler slows Python-heavy work (``torch.compile`` most of all), so a profiled run's times are for
attribution only, never for the race's table.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
from pathlib import Path


@contextlib.contextmanager
def maybe_profile(out_dir: str | None, name: str, top: int = 40):
    if not out_dir:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"{name}.txt").write_text(buf.getvalue())
