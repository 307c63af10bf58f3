"""The work dir: what rlcli owns in it, when a run may start, resume or must be refused, and when a
run is finished.

rlcli writes a manifest, ``rlcli-manifest.json``, into every work dir it uses: the top-level names
it owns (:data:`RUN_OUTPUTS`) and, once a run has ended, its last step and the fingerprint of its
recipe. Everything else in the directory is the user's: rlcli never deletes, replaces or writes
into it, ``--overwrite`` included.

* A directory without a manifest that holds anything is refused, unless ``--overwrite`` (then rlcli
  writes its outputs beside those files). A directory holding an entry under one of rlcli's names
  that rlcli did not write is refused even with ``--overwrite``. A directory written by an rlcli
  from before the manifest (an rlcli ``resolved.yaml``, or complete checkpoints) is adopted.
* ``trainer.auto_resume``: a finished run of the same recipe is only reported; otherwise the
  newest complete checkpoint is resumed; without one, the outputs of a run that died before its
  first checkpoint are cleared. A finished run (or one of an older rlcli that may have finished)
  with no checkpoint to continue from is refused: its results are never deleted without
  ``--overwrite``.
* Without ``auto_resume`` a directory holding a run is refused unless ``--overwrite``.
* ``--overwrite`` deletes rlcli's own outputs only (``rlcli eval``'s ``eval/<name>/`` are kept).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rlcli import __version__

log = logging.getLogger(__name__)

MANIFEST = "rlcli-manifest.json"
RUN_OUTPUTS = ("metrics.jsonl", "tensorboard", "checkpoints", "hf", "eval", "rollouts", "model-init",
               "resolved.yaml", "run.log", "trained_groups.jsonl", "skipped_rows.jsonl", "trackers")
# The files among RUN_OUTPUTS that rlcli writes whole through a temporary file (fsutil.write_text:
# ``.<name>.<random>.tmp``; an older rlcli used ``<name>.tmp``), and the directory it swaps in
# (fsutil.publish_dir: ``model-init.tmp``, ``model-init.old``). Only these leftover names are rlcli's:
# a user's ``hf.old`` or ``metrics.jsonl.bak`` is the user's.
_TMP_WRITTEN = ("metrics.jsonl", "resolved.yaml", "trained_groups.jsonl", "skipped_rows.jsonl", MANIFEST)
_SWAPPED_IN = ("model-init",)
_FIX = "set --work-dir (or trainer.work_dir) to another directory"


class WorkDirError(RuntimeError):
    """A work dir rlcli cannot or must not use; the message names the path and the fix."""


class WorkDirInUse(WorkDirError):
    """The work dir holds files that a run there would delete or write into."""


@dataclass
class WorkDirPlan:
    """What :func:`plan_work_dir` decided; nothing is changed on disk until :func:`prepare_work_dir`."""

    checkpoint: Path | None  # resume from it
    clear: list[str]  # rlcli's own entries to remove first (a fresh start)
    finished: dict | None  # this recipe's run is finished: its last metrics row (nothing to do)


def check_dir_path(path: Path, what: str = "work dir", option: str = "--work-dir (or trainer.work_dir)") -> None:
    """Raise :class:`WorkDirError` when ``path`` is a file, lies under a file, or is not writable;
    the message names ``what`` it is and the ``option`` that sets it."""
    fix = f"set {option} to another directory"
    chain = [path, *path.parents]
    for p in reversed(chain):  # the outermost first
        if p.exists() and not p.is_dir():
            if p == path:
                raise WorkDirError(f"{what} {path} is a file, not a directory; {fix}")
            raise WorkDirError(f"{what} {path} cannot be created: {p} is a file; {fix}")
    existing = next(p for p in chain if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" ({existing} is read-only for this user)"
        raise WorkDirError(f"{what} {path} is not writable{where}; make it writable (chmod u+w {existing}) "
                           f"or {fix}")


def recipe_fingerprint(recipe) -> str:
    """A hash of the fully resolved recipe: a rerun of the same recipe has the same fingerprint."""
    return hashlib.sha256(recipe_record(recipe).encode()).hexdigest()


def plan_work_dir(work_dir: Path, *, auto_resume: bool, overwrite: bool, recipe=None) -> WorkDirPlan:
    """Decide between resuming, starting fresh, reporting a finished run and refusing (raises
    :class:`WorkDirError`); reads only. ``recipe``: the run's recipe (to recognise its finished run)."""
    from rlcli.train.checkpoint import latest_checkpoint

    manifest = _check_owner(work_dir, overwrite)
    entries = _entries(work_dir)
    finished = (manifest or {}).get("finished")
    if auto_resume and not overwrite and finished and recipe is not None \
            and finished.get("recipe") == recipe_fingerprint(recipe):
        return WorkDirPlan(None, [], _last_row(work_dir) or {"step": finished["step"]})
    ckpt = latest_checkpoint(work_dir / "checkpoints") if auto_resume and not overwrite else None
    if ckpt is not None:
        return WorkDirPlan(ckpt, [], None)
    held = _results(work_dir)
    if held and not overwrite:
        if not auto_resume:
            raise WorkDirInUse(
                f"{work_dir} already holds a run ({', '.join(held)}); pass --overwrite to replace it (only what "
                f"rlcli wrote is deleted), set trainer.auto_resume=true to continue it, or {_FIX}")
        if finished:
            which = ("a finished run" if finished.get("recipe") else
                     "a run of an older rlcli that may have finished")
            raise WorkDirInUse(
                f"{work_dir} holds {which} (last step {finished['step']}) and no checkpoint to continue it "
                f"from; rlcli keeps its results: pass --overwrite to replace them, or {_FIX}")
    return WorkDirPlan(None, [e for e in entries if _owned(e, RUN_OUTPUTS)], None)


def prepare_work_dir(work_dir: Path, *, auto_resume: bool, overwrite: bool) -> Path | None:
    """Carry out :func:`plan_work_dir` (rank 0): write the manifest, clear rlcli's own outputs for a
    fresh start, recover the HF exports a killed run left half-published; return the checkpoint to
    resume from. (A finished run is reported by :func:`rlcli.runner.run` before any runner is built.)"""
    from rlcli.fsutil import clean_interrupted
    from rlcli.train.weights import is_complete_export

    plan = plan_work_dir(work_dir, auto_resume=auto_resume, overwrite=overwrite)
    _write_manifest(work_dir, None)
    for name in plan.clear:
        _remove_output(work_dir / name)
    clean_interrupted(work_dir / "hf", is_complete_export)
    return plan.checkpoint


def claim_work_dir(work_dir: Path) -> None:
    """Make ``work_dir`` rlcli's before a command other than ``train`` writes into it (``rlcli eval``):
    refused when it holds files rlcli did not write; the manifest is written when missing."""
    manifest = _check_owner(work_dir, overwrite=False)
    if not (work_dir / MANIFEST).is_file():
        _write_manifest(work_dir, (manifest or {}).get("finished"))


def recipe_record(recipe) -> str:
    """The resolved recipe as a JSON string, for a checkpoint's extra state (plain data)."""
    from rlcli.config import resolved_dict

    return json.dumps(resolved_dict(recipe), sort_keys=True, default=str)


def recipe_changes(saved: str | None, recipe) -> list[str]:
    """The dotted keys whose values differ between the recipe a checkpoint was saved with
    (:func:`recipe_record`; None for a checkpoint of an older rlcli: nothing known) and ``recipe``,
    each as ``key: old -> new``."""
    if saved is None:
        return []

    def flat(node, prefix=""):
        if isinstance(node, dict):
            return {k: v for key, val in node.items() for k, v in flat(val, f"{prefix}{key}.").items()}
        if isinstance(node, list) and any(isinstance(x, (dict, list)) for x in node):
            return {k: v for i, val in enumerate(node) for k, v in flat(val, f"{prefix}{i}.").items()}
        return {prefix[:-1]: node}

    old, new = flat(json.loads(saved)), flat(json.loads(recipe_record(recipe)))
    unset = "(unset)"
    return [f"{k}: {old.get(k, unset)!r} -> {new.get(k, unset)!r}" for k in sorted(set(old) | set(new))
            if old.get(k, unset) != new.get(k, unset)]


def note_recipe_changes(saved: str | None, recipe, path: Path) -> list[str]:
    """Log (a warning) which recipe keys changed since the checkpoint at ``path`` was saved: the
    resumed run follows the new recipe, so it will not end as either recipe's uninterrupted run."""
    changes = recipe_changes(saved, recipe)
    if changes:
        shown = "; ".join(changes[:12]) + (f"; and {len(changes) - 12} more" if len(changes) > 12 else "")
        log.warning("resuming from %s with a changed recipe (the run continues with the new one; the "
                    "checkpoint's extra state keeps the old): %s", path, shown)
    return changes


def mark_finished(work_dir: Path, step: int, recipe) -> None:
    """Record that the run of ``recipe`` in ``work_dir`` ended at ``step`` (the final export written)."""
    _write_manifest(work_dir, {"step": step, "recipe": recipe_fingerprint(recipe)})


def export_missing(work_dir: Path, step: int, schedule) -> bool:
    """Whether the HF export due after ``step`` is missing or partial (a run killed while writing it)."""
    from rlcli.train.weights import is_complete_export

    return step > 0 and schedule.hf_export_due(step) and not is_complete_export(work_dir / "hf" / f"step-{step}")


# ----------------------------------------------------------------------------- helpers
def _check_owner(work_dir: Path, overwrite: bool) -> dict | None:
    """The manifest (read, or adopted from an older rlcli); raises when rlcli must not write here."""
    check_dir_path(work_dir)
    manifest = _read_manifest(work_dir)
    foreign = [e for e in _entries(work_dir) if manifest is None or not _owned(e, manifest["owned"])]
    taken = [e for e in foreign if _owned(e, RUN_OUTPUTS)]
    if taken:
        raise WorkDirInUse(
            f"{work_dir} holds {', '.join(taken)}, which rlcli did not write but writes a run's outputs "
            f"under; rlcli never deletes or writes into files it did not write, even with --overwrite: "
            f"move them elsewhere, or {_FIX}")
    if foreign and manifest is None and not overwrite:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise WorkDirInUse(
            f"{work_dir} holds files rlcli did not write ({shown}); {_FIX}, or pass --overwrite to use this "
            f"one anyway (rlcli then writes only its own outputs beside them and never touches them)")
    return manifest


def _owned(name: str, owned) -> bool:
    """Whether ``name`` is one of the ``owned`` names, or a leftover of rlcli's writing one of them."""
    if name in owned:
        return True
    if name.startswith(".") and name.endswith(".tmp"):  # .<name>.<random>.tmp
        base = name[1:-4].rpartition(".")[0]
        return base in owned and base in _TMP_WRITTEN
    if name.endswith(".tmp"):
        base = name[:-4]
        return base in owned and (base in _TMP_WRITTEN or base in _SWAPPED_IN)
    if name.endswith(".old"):
        base = name[:-4]
        return base in owned and base in _SWAPPED_IN
    return False


def _entries(work_dir: Path) -> list[str]:
    if not work_dir.is_dir():
        return []
    try:
        return sorted(p.name for p in work_dir.iterdir() if not _owned(p.name, (MANIFEST,)))
    except OSError as exc:
        raise WorkDirError(f"cannot list work dir {work_dir}: {exc.strerror or exc}; make it readable or {_FIX}") from exc


def _read_manifest(work_dir: Path) -> dict | None:
    """The manifest; for a directory an older rlcli wrote (no manifest yet), the adopted one."""
    try:
        data = json.loads((work_dir / MANIFEST).read_text(encoding="utf-8"))
        if isinstance(data, dict) and isinstance(data.get("owned"), list):
            return data
    except (OSError, ValueError):
        pass
    if not _written_by_old_rlcli(work_dir):
        return None
    last = _last_row(work_dir)
    return {"owned": list(RUN_OUTPUTS), "finished": {"step": last.get("step"), "recipe": None} if last else None}


def _written_by_old_rlcli(work_dir: Path) -> bool:
    import yaml

    from rlcli.train.checkpoint import list_checkpoints

    try:
        resolved = yaml.safe_load((work_dir / "resolved.yaml").read_text(encoding="utf-8"))
        if isinstance(resolved, dict) and {"recipe", "plugins", "versions"} <= set(resolved):
            return True
    except (OSError, ValueError, yaml.YAMLError):
        pass
    return bool(list_checkpoints(work_dir / "checkpoints"))


def _write_manifest(work_dir: Path, finished: dict | None) -> None:
    """Write the manifest atomically; creating it is also the proof that the directory is writable."""
    from rlcli.fsutil import WriteError, write_text

    data = {"format": 1, "written_by": f"rlcli {__version__}", "owned": list(RUN_OUTPUTS), "finished": finished}
    try:
        write_text(work_dir / MANIFEST, json.dumps(data, indent=2) + "\n")
    except WriteError as exc:
        raise WorkDirError(f"cannot write into work dir {work_dir}: {exc.cause.strerror or exc.cause}; make it "
                           f"writable or {_FIX}") from exc


def _last_row(work_dir: Path) -> dict:
    """The last complete row of ``metrics.jsonl`` ({} when there is none)."""
    try:
        lines = (work_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line from a killed process
        if isinstance(row, dict) and "step" in row:
            return row
    return {}


def _results(work_dir: Path) -> list[str]:
    """The entries that make ``work_dir`` hold a run: logged steps, checkpoints, HF exports."""
    held = []
    if (work_dir / "metrics.jsonl").is_file() and (work_dir / "metrics.jsonl").stat().st_size > 0:
        held.append("metrics.jsonl")
    held += [n for n in ("checkpoints", "hf") if (work_dir / n).is_dir() and any((work_dir / n).iterdir())]
    return held


def _remove_output(path: Path) -> None:
    """Remove one of rlcli's outputs; under ``eval/`` only the training evals (``step-N.jsonl``):
    the ``eval/<name>/`` results of ``rlcli eval`` are kept."""
    if path.name == "eval" and path.is_dir() and not path.is_symlink():
        for p in path.glob("step-*.jsonl*"):
            p.unlink()
        if not any(path.iterdir()):
            path.rmdir()
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
