"""``rlcli report``: one self-contained HTML page about one run, or several runs overlaid.

The page has no external references at all (no scripts, fonts, stylesheets or images from
anywhere): figures are base64 PNG ``data:`` URIs, the stylesheet is inline, and the only
interactivity is HTML's own ``<details>``. It opens offline and can be mailed as one file.

Every section is built from what the work dirs hold *now*: a run in progress (or a crashed one)
gets a report of what it has logged so far, and a section whose inputs are missing says which
file is missing instead of failing the whole page.
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from rlcli.fsutil import write_text
from rlcli.report.markup import Section, esc, missing
from rlcli.report.rundata import ReportError, Run, load_runs
from rlcli.report.samples import section_config, section_samples
from rlcli.report.sections import (
    section_health,
    section_length,
    section_mismatch,
    section_reward,
    section_summary,
    section_throughput,
    section_time,
    section_training,
)

log = logging.getLogger(__name__)


SECTIONS: list[Callable[[Sequence[Run]], Section]] = [
    section_summary, section_reward, section_length, section_health, section_time, section_throughput,
    section_training, section_mismatch, section_config, section_samples,
]


_CSS = """
:root { --fg:#1d1d1f; --muted:#666; --line:#e3e3e3; --bg2:#f6f7f9; --best:#2e7d32; --worst:#c62828; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: var(--fg);
       margin: 0; background: #fff; }
header { padding: 14px 24px 8px; border-bottom: 1px solid var(--line); }
header h1 { margin: 0 0 4px; font-size: 20px; }
header .meta { color: var(--muted); font-size: 12px; }
nav { position: sticky; top: 0; background: #fff; border-bottom: 1px solid var(--line); padding: 6px 24px; z-index: 1; }
nav a { margin-right: 14px; color: #0b57d0; text-decoration: none; font-size: 13px; }
main { padding: 0 24px 40px; max-width: 1180px; }
section { margin-top: 22px; }
h2 { font-size: 17px; border-bottom: 2px solid var(--line); padding-bottom: 4px; margin: 0 0 10px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
h4 { font-size: 13px; margin: 12px 0 4px; color: #333; }
img.plot { display: block; max-width: 100%; height: auto; margin: 6px 0; }
table { border-collapse: collapse; margin: 8px 0; font-size: 12.5px; }
th, td { border: 1px solid var(--line); padding: 4px 7px; text-align: left; vertical-align: top; }
th { background: var(--bg2); font-weight: 600; }
table.summary td:first-child { white-space: nowrap; }
table.num td:not(:first-child) { text-align: right; font-variant-numeric: tabular-nums; }
table.samples { width: 100%; table-layout: fixed; }
table.samples th:nth-child(1) { width: 52px; } table.samples th:nth-child(2) { width: 64px; }
table.samples th:nth-child(3) { width: 100px; } table.samples th:nth-child(6) { width: 120px; }
table.samples th:nth-child(7) { width: 90px; }
table.samples tr.best td:first-child { border-left: 3px solid var(--best); }
table.samples tr.worst td:first-child { border-left: 3px solid var(--worst); }
pre, span.pre { margin: 0; white-space: pre-wrap; word-break: break-word;
                font: 12px/1.35 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
span.pre { display: block; }
details.clip > summary { cursor: pointer; list-style: none; }
details.clip > summary::-webkit-details-marker { display: none; }
details.clip .more { color: #0b57d0; font-size: 11px; }
details.clip[open] > summary { display: none; }
details.step, details.recipe { border: 1px solid var(--line); border-radius: 4px; padding: 4px 10px; margin: 8px 0; }
details.step > summary, details.recipe > summary { cursor: pointer; font-weight: 600; }
details.recipe pre { background: var(--bg2); padding: 8px; max-height: 640px; overflow: auto; }
.tag { font-size: 11px; font-weight: 600; }
.tag.best { color: var(--best); } .tag.worst { color: var(--worst); }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 6px;
          vertical-align: -1px; }
.missing { color: #8a5a00; background: #fff6e0; border-left: 3px solid #e0a800; padding: 6px 10px; }
.ok { color: #1b5e20; }
.note { color: var(--muted); font-size: 12px; }
ul.notes { color: #8a5a00; font-size: 12.5px; }
code { font: 12px ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
"""


def _safe(build: Callable[[Sequence[Run]], Section], runs: Sequence[Run]) -> Section:
    try:
        return build(runs)
    except Exception as exc:  # one odd file must not cost the whole report
        log.warning("report section %s failed", build.__name__, exc_info=True)
        name = build.__name__.removeprefix("section_")
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return Section(name, name.capitalize(), missing(f"This section could not be built: {tb}"))


GENERATOR = "<meta name='generator' content='rlcli report'>"
_OLD_MARK = "</div></header>"  # with "by rlcli": the header of a report from before GENERATOR


def written_by_rlcli(path: Path) -> bool:
    """Whether the file at ``path`` is a page ``rlcli report`` wrote (so it may replace it)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    return GENERATOR in head or ("<title>rlcli report: " in head and " by rlcli " in head and _OLD_MARK in head)


def render_report(runs: Sequence[Run]) -> str:
    """The whole page as a string."""
    sections = [_safe(b, runs) for b in SECTIONS]
    names = ", ".join(r.label for r in runs)
    title = f"rlcli report: {names}"
    when = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    nav = "".join(f'<a href="#{s.id}">{esc(s.title)}</a>' for s in sections)
    body = "".join(f'<section id="{s.id}"><h2>{esc(s.title)}</h2>{s.body}</section>' for s in sections)
    from rlcli import __version__

    return (
        f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>{GENERATOR}"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>{esc(title)}</h1><div class='meta'>generated {esc(when)} by rlcli {esc(__version__)} · "
        f"{len(runs)} run{'s' if len(runs) != 1 else ''}</div></header>"
        f"<nav>{nav}</nav><main>{body}</main></body></html>\n"
    )


def write_report(work_dirs: list[Path], out: Path | None = None) -> Path:
    """Render the report of ``work_dirs`` (overlaid when several) to ``out`` (default: first dir's report.html).

    Raises :class:`rlcli.report.ReportError` when a path is not a run's work dir at all, or when the
    default page's place holds a file or link that ``rlcli report`` did not write (rlcli never replaces
    files it did not write; ``out`` is the user's explicit choice).
    """
    t0 = time.perf_counter()
    runs = load_runs([Path(w) for w in work_dirs])
    page = render_report(runs)
    if out is None:
        out = Path(work_dirs[0]) / "report.html"
        if out.is_symlink() or (out.exists() and not written_by_rlcli(out)):
            raise ReportError(f"{out} exists and was not written by rlcli report; rlcli does not replace it: "
                              f"move it, or pass --out FILE to write the page elsewhere")
    out = Path(out)
    write_text(out, page)  # a browser reloading the page never sees half a file
    log.info("report %s written in %.2fs", out, time.perf_counter() - t0)
    return out
