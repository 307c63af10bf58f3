"""The ``rlcli`` command line.

    rlcli train RECIPE [KEY=VALUE ...] [--work-dir DIR]
    rlcli eval RECIPE [--checkpoint DIR] [KEY=VALUE ...]
    rlcli validate RECIPE [KEY=VALUE ...] [--nproc-per-node N]
    rlcli plugins [--json]
    rlcli new judger|agent-loop NAME [--dir DIR]
    rlcli recipes
    rlcli data gsm8k IN OUT
    rlcli data convert IN.jsonl OUT.parquet

Overrides are dotted paths with YAML values (``trainer.seed=3``, ``tasks.0.judger.name=gsm8k``);
``~KEY`` deletes a key. Heavy imports (torch, transformers) happen inside the commands so that
``rlcli --help`` stays fast and works even when a plugin is broken.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import click

from rlcli import DEBUG_ENV, __version__, debug_enabled

EXIT_RECIPE_ERROR = 2


def _load(recipe: str, overrides: tuple[str, ...]):
    from rlcli.config import RecipeError, load_recipe
    from rlcli.plugins import PluginError

    try:
        return load_recipe(recipe, overrides)
    except RecipeError as exc:
        _fail(str(exc), EXIT_RECIPE_ERROR)
    except PluginError as exc:
        _fail(f"plugin error: {exc}", EXIT_RECIPE_ERROR)


def _out_of_memory_hint() -> str:
    """What a run that ran out of GPU memory can change: the recipe keys that free memory, in the order
    worth trying (tests/test_cli.py checks that each names a recipe key)."""
    return ("the GPU ran out of memory. What frees memory (docs/recipes.md#memory): "
            "resources.expandable_segments=true when the error reports much memory reserved but unallocated; "
            "a smaller train_worker.pack_max_length; train_worker.optimizer.moment_dtype=bfloat16; "
            "train_worker.fsdp.activation_memory_budget below 1 (with torch_compile); model.lora; "
            "train_worker.kl.ref_offload=true; train_worker.fsdp.cpu_offload=true; for an engine plugin, its "
            "KV-cache option. Checkpoints already written are whole: with trainer.auto_resume the run continues "
            "from the last one.")


def _fail(message: str, code: int) -> NoReturn:
    """Print ``message`` (red, stderr) and exit with ``code``; with ``--debug`` (``RLCLI_DEBUG=1``) the
    traceback of the exception being handled comes first."""
    if debug_enabled() and sys.exc_info()[1] is not None:
        traceback.print_exc()
    click.secho(message, fg="red", err=True)
    sys.exit(code)


def _recipe_file(recipe: str) -> str:
    """``recipe`` as given when it is a file; else the built-in recipe of that name, as ``rlcli recipes``
    lists it (``quickstart.yaml`` or ``quickstart``) from any directory; else as given (reported missing)."""
    if Path(recipe).exists() or os.sep in recipe:
        return recipe
    for cand in (_builtin_recipes_dir() / recipe, _builtin_recipes_dir() / f"{recipe}.yaml"):
        if cand.is_file():
            return str(cand)
    return recipe


def _builtin_recipes_dir() -> Path:
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "recipes", here / "recipes"):
        if cand.is_dir():
            return cand
    return here.parent / "recipes"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rlcli")
@click.option("--debug", is_flag=True,
              help=f"Full tracebacks where rlcli prints one-line errors (same as {DEBUG_ENV}=1; ranks inherit it).")
def cli(debug: bool) -> None:
    """Reinforcement learning for language models (GRPO and family) from one YAML recipe."""
    if debug:
        os.environ[DEBUG_ENV] = "1"


@cli.command(context_settings={"ignore_unknown_options": True})
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@click.option("--work-dir", type=click.Path(file_okay=False), help="Where outputs go (default: trainer.work_dir).")
@click.option("--quiet", is_flag=True, help="No progress bars or per-step lines (the final result line only).")
@click.option("--overwrite", is_flag=True,
              help="Start afresh: delete the outputs rlcli wrote in the work dir (never other files), or use a "
                   "directory that holds other files.")
@click.option("--nproc-per-node", type=int, default=1, show_default=True,
              help="Ranks on this machine (one per GPU; gloo ranks on CPU), as torchrun.")
@click.option("--nnodes", type=int, default=1, show_default=True, help="Machines in the run, as torchrun.")
@click.option("--node-rank", type=int, default=0, show_default=True, help="This machine's index, as torchrun.")
@click.option("--master-addr", help="Address of node 0 (needed with --nnodes > 1).")
@click.option("--master-port", type=int, help="Port on node 0 (needed with --nnodes > 1).")
def train(recipe: str, overrides: tuple[str, ...], work_dir: str | None, quiet: bool, overwrite: bool,
          nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str | None, master_port: int | None) -> None:
    """Train with RECIPE, applying KEY=VALUE / ~KEY overrides.

    \b
    examples:
      rlcli train recipes/quickstart.yaml
      rlcli train recipes/quickstart.yaml trainer.seed=2 trainer.total_train_steps=50
      rlcli train recipes/gsm8k-colocate.yaml model.path=/models/Qwen2.5-0.5B-Instruct
    """
    recipe = _recipe_file(recipe)
    rec = _load(recipe, overrides)
    from rlcli.launch import LaunchSpec, RankFailed, launch
    from rlcli.runner import rank_entry, run
    from rlcli.runner.setup import default_work_dir
    from rlcli.runner.workdir import WorkDirError, plan_work_dir
    from rlcli.train.divergence import DivergedError

    path_errors = _path_errors()
    spec = LaunchSpec(nproc_per_node, nnodes, node_rank, master_addr, master_port)
    disaggregated = rec.trainer.mode == "disaggregated"
    _check_launch(recipe, rec, spec.world_size)  # the recipe against the ranks, before any rank starts
    try:
        spec.check()
        plan = plan_work_dir(Path(work_dir) if work_dir else default_work_dir(rec),
                             auto_resume=rec.trainer.auto_resume, overwrite=overwrite, recipe=rec)  # before any rank
        if (spec.world_size == 1 and not disaggregated) or plan.finished is not None:  # a finished run: reported
            path, final = run(rec, work_dir, quiet=quiet, overwrite=overwrite)
        else:
            results = launch(spec, rank_entry, recipe, list(overrides), work_dir, quiet, overwrite)
            main_result = results.get(0)
            if main_result is None:  # not node 0: rank 0 reports
                return
            path, final = main_result
    except (WorkDirError, *path_errors) as exc:
        _fail(str(exc), EXIT_RECIPE_ERROR)
    except RankFailed as exc:  # its message holds the ranks' tracebacks
        named = [m.split(": ", 1)[1] for m in exc.errors.values()
                 if m.split(": ", 1)[0] in {e.__name__ for e in path_errors}]
        if named and debug_enabled():
            click.echo(str(exc), err=True)
        oom = any(m.split(": ", 1)[0].endswith("OutOfMemoryError") for m in exc.errors.values())
        _fail("\n".join(named) if named else f"training failed: {exc}" + (f"\n{_out_of_memory_hint()}" if oom else ""),
              EXIT_RECIPE_ERROR if named else 1)
    except (ValueError, DivergedError) as exc:
        _fail(f"training failed: {exc}", 1)
    except Exception as exc:
        if type(exc).__name__ != "OutOfMemoryError":  # torch.OutOfMemoryError (torch.cuda's too)
            raise
        _fail(f"training failed: {str(exc).splitlines()[0] if str(exc) else exc!r}\n{_out_of_memory_hint()}", 1)
    from rlcli.runner.records import final_summary

    click.echo(f"done: {path} | {final_summary(final)}".rstrip(" |"))  # with --quiet too: the result


@cli.command("eval", context_settings={"ignore_unknown_options": True})
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False),
              help="An HF export (hf/step-N) or a training checkpoint (checkpoints/step-N); default: the base model.")
@click.option("--out-dir", type=click.Path(file_okay=False), help="Where eval.jsonl and eval_metrics.json go.")
def eval_cmd(recipe: str, overrides: tuple[str, ...], checkpoint: str | None, out_dir: str | None) -> None:
    """Evaluate a checkpoint (or the base model) on RECIPE's eval tasks.

    \b
    examples:
      rlcli eval recipes/quickstart.yaml --checkpoint work_dirs/quickstart/hf/step-200
    """
    recipe = _recipe_file(recipe)
    rec = _load(recipe, overrides)
    if rec.eval is None or not rec.eval.tasks:
        _fail(f"{recipe}: the recipe has no eval.tasks to evaluate", EXIT_RECIPE_ERROR)
    from rlcli.runner.eval_command import run_eval
    from rlcli.runner.workdir import WorkDirError

    try:
        metrics, out = run_eval(rec, checkpoint, out_dir)
    except (WorkDirError, *_path_errors()) as exc:
        _fail(str(exc), EXIT_RECIPE_ERROR)
    from rlcli.runner.records import eval_lines

    for line in eval_lines(metrics):
        click.echo(line)
    click.echo(f"wrote {out / 'eval.jsonl'} and {out / 'eval_metrics.json'} (with the engine's and judgers' counters)")


def _path_errors() -> tuple[type[Exception], ...]:
    """Errors that end ``train`` and ``eval`` with their message and exit 2, each naming its file or
    field: a checkpoint refused (unsafe or damaged), a write that failed (a full disk), a data file
    with no usable row, a judger the default process executor cannot pickle, a model that cannot
    be found or fetched, and a recipe problem only the model shows (``model.lora.target_modules``
    matching no layer)."""
    from rlcli.config import RecipeError
    from rlcli.data.base import DataError
    from rlcli.fsutil import WriteError
    from rlcli.hub import ModelLocationError
    from rlcli.judgers.pool import JudgerNotPicklable
    from rlcli.train.checkpoint_files import CheckpointError

    return CheckpointError, WriteError, DataError, JudgerNotPicklable, ModelLocationError, RecipeError


def _check_launch(recipe: str, rec, world_size: int) -> None:
    """Exit 2 listing every problem of ``rec`` launched on ``world_size`` ranks (groups per rank, placements)."""
    from rlcli.config import RecipeError, check_launch

    issues = check_launch(rec, world_size)
    if issues:
        _fail(str(RecipeError(issues, recipe)), EXIT_RECIPE_ERROR)


@cli.command(context_settings={"ignore_unknown_options": True})
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Also check the recipe against a launch of this many ranks per machine (groups per rank, "
                   "disaggregated placements), as `rlcli train --nproc-per-node`.")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Machines of that launch (with --nproc-per-node).")
def validate(recipe: str, overrides: tuple[str, ...], nproc_per_node: int | None, nnodes: int) -> None:
    """Check RECIPE (with overrides) without loading any model; list every problem (exit 2)."""
    recipe = _recipe_file(recipe)
    rec = _load(recipe, overrides)
    if nproc_per_node is not None:
        _check_launch(recipe, rec, nproc_per_node * nnodes)
    comps = rec.components()
    click.secho(f"{recipe}: OK ({len(comps)} components resolved)", fg="green")
    for path, kind, spec in comps:
        click.echo(f"  {path}: {kind} {spec.name}")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins(as_json: bool) -> None:
    """Every registered component by kind: name, providing distribution and version."""
    from rlcli.plugins import KINDS, get_registry

    reg = get_registry()
    rows = [
        {"kind": kind, "name": e.name, "distribution": e.dist, "version": e.version, "description": e.description}
        for kind in KINDS for e in sorted(reg.entries[kind].values(), key=lambda e: e.name)
    ]
    broken = [{"distribution": d, "entry_point": ep, "error": err} for d, ep, err in reg.broken]
    clashes = [{"kind": kind, "name": name, "providers": [
        {"distribution": e.dist, "version": e.version, "module": e.cls.__module__} for e in entries]}
        for (kind, name), entries in reg.clashes.items()]
    if as_json:
        click.echo(json.dumps({"components": rows, "broken": broken, "clashes": clashes}, indent=2))
        return
    for r in rows:
        r["provider"] = f"{r['distribution']} {r['version']}"
    width = max([16, *(len(r["provider"]) for r in rows)])
    for kind in KINDS:
        click.secho(kind, bold=True)
        for r in (r for r in rows if r["kind"] == kind):
            click.echo(f"  {r['name']:<22} {r['provider']:<{width}} {r['description']}")
    for b in broken:
        click.secho(f"broken plugin {b['distribution']} ({b['entry_point']}): {b['error']}", fg="red")
    for (kind, name), entries in reg.clashes.items():  # the name is unusable; every other one works
        providers = " and by ".join(f"{e.dist} {e.version} ({e.cls.__module__})" for e in entries)
        click.secho(f"name clash: {kind} {name!r} is registered by {providers}; recipes that use it fail "
                    f"until one is uninstalled", fg="red")


@cli.command()
def recipes() -> None:
    """The built-in recipes, one line each (train, eval and validate take these names from any directory)."""
    import yaml

    root = _builtin_recipes_dir()
    for p in sorted(root.glob("*.yaml")):
        try:
            desc = (yaml.safe_load(p.read_text()) or {}).get("description", "")
        except yaml.YAMLError:
            desc = "(unreadable YAML)"
        click.echo(f"{p.name:<34} {str(desc).strip().splitlines()[0] if desc else ''}")


@cli.group()
def data() -> None:
    """Datasets: convert, check, and write the toy tasks."""


@data.command("gsm8k")
@click.argument("in_path", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_path", type=click.Path(dir_okay=False))
def data_gsm8k(in_path: str, out_path: str) -> None:
    """Convert raw GSM8K (question/answer with '#### n') to RL JSONL."""
    from rlcli.data.base import DataError
    from rlcli.data.gsm8k import convert_gsm8k

    try:
        written, skipped = convert_gsm8k(in_path, out_path)
    except OSError as exc:
        _fail(f"cannot convert {in_path} to {out_path}: {exc.strerror or exc}", EXIT_RECIPE_ERROR)
    except DataError as exc:  # no usable row: nothing written
        for msg in exc.skipped:
            click.secho(f"  {msg}", fg="yellow", err=True)
        _fail(str(exc), EXIT_RECIPE_ERROR)
    click.echo(f"wrote {written} rows to {out_path}" + (f"; skipped {len(skipped)} malformed rows" if skipped else ""))
    for msg in skipped:  # every one, located
        click.secho(f"  {msg}", fg="yellow", err=True)


@data.command("convert")
@click.argument("in_path", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_path", type=click.Path(dir_okay=False))
def data_convert(in_path: str, out_path: str) -> None:
    """RL JSONL <-> verl-format parquet, by the files' suffixes (.jsonl / .parquet); bad rows are
    left out and listed (needs `pip install 'rlcli[data]'`)."""
    from rlcli.data.base import DataError
    from rlcli.data.tables import jsonl_to_parquet, parquet_to_jsonl

    kinds = (Path(in_path).suffix, Path(out_path).suffix)
    convert = {(".jsonl", ".parquet"): jsonl_to_parquet, (".parquet", ".jsonl"): parquet_to_jsonl}.get(kinds)
    if convert is None:
        _fail(f"cannot convert {in_path} to {out_path}: convert goes from .jsonl to .parquet or from .parquet "
              "to .jsonl (name the files so)", EXIT_RECIPE_ERROR)
    try:
        written, skipped = convert(in_path, out_path)
    except DataError as exc:
        _fail(str(exc), EXIT_RECIPE_ERROR)
    except OSError as exc:
        _fail(f"cannot convert {in_path} to {out_path}: {exc.strerror or exc}", EXIT_RECIPE_ERROR)
    click.echo(f"wrote {written} rows to {out_path}" + (f"; skipped {len(skipped)} bad rows" if skipped else ""))
    for row in skipped:  # every one, located
        click.secho(f"  {row}", fg="yellow", err=True)


@data.command("check")
@click.argument("path", type=click.Path(exists=True))
@click.option("--no-label", "no_label", is_flag=True,
              help="Rows without reward_model.ground_truth are usable (a sampler's require_label: false).")
@click.option("--split", default="train", show_default=True, help="The split of a Hugging Face dataset.")
@click.option("--show", type=click.IntRange(min=0), default=20, show_default=True,
              help="How many bad rows to list (all are counted).")
def data_check(path: str, no_label: bool, split: str, show: int) -> None:
    """Read every row of a dataset (.jsonl, .parquet or a Hugging Face dataset) as a training run
    would: count the usable rows, list the bad ones by file:line with the reason (exit 1 if any)."""
    from tqdm.auto import tqdm

    from rlcli.data.base import DataError
    from rlcli.data.check import check_dataset

    try:
        with tqdm(desc="rows", unit="row", delay=2.0, file=sys.stderr) as bar:
            found = check_dataset(path, require_label=not no_label, split=split, progress=bar.update)
    except DataError as exc:
        _fail(str(exc), EXIT_RECIPE_ERROR)
    except OSError as exc:
        _fail(f"cannot read {path}: {exc.strerror or exc}", EXIT_RECIPE_ERROR)
    click.echo(found.summary())
    for row in found.skipped[:show]:
        click.secho(f"  {row}", fg="yellow", err=True)
    if len(found.skipped) > show:
        click.secho(f"  ... and {len(found.skipped) - show} more (--show N lists more)", fg="yellow", err=True)
    if found.skipped and not found.usable and all(r.kind == "shape" for r in found.skipped):
        click.echo("no row is an RL row ({data_source, prompt, reward_model, extra_info}; docs/recipes.md): raw "
                   "GSM8K converts with `rlcli data gsm8k IN OUT`")
    if found.skipped or not found.usable:
        sys.exit(1)


@data.command("arith")
@click.argument("out_dir", type=click.Path(file_okay=False))
def data_arith(out_dir: str) -> None:
    """Write the quickstart's toy task ((a + b) mod 10) as RL JSONL into OUT_DIR."""
    from rlcli.data.arith import write_arith

    paths = write_arith(out_dir)
    click.echo("wrote " + ", ".join(str(p) for p in paths))


@data.command("reverse")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the training sample.")
def data_reverse(out_dir: str, seed: int) -> None:
    """Write the multi-token toy task (digit strings backwards; train and held-out disjoint) into OUT_DIR."""
    from rlcli.data.reverse import write_reverse

    paths = write_reverse(out_dir, seed)
    click.echo("wrote " + ", ".join(str(p) for p in paths))


@data.command("tool-arith")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--train", "n_train", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Training problems.")
@click.option("--test", "n_test", type=click.IntRange(min=1), default=200, show_default=True,
              help="Held-out problems (no operand pair in common with training).")
@click.option("--seed", type=int, default=0, show_default=True, help="Generator seed.")
def data_tool_arith(out_dir: str, n_train: int, n_test: int, seed: int) -> None:
    """Write the tool-use toy task (products of 2-3 digit numbers) as RL JSONL into OUT_DIR."""
    from rlcli.data.tool_arith import write_tool_arith

    paths = write_tool_arith(out_dir, n_train, n_test, seed)
    click.echo("wrote " + ", ".join(str(p) for p in paths))


@cli.group()
def new() -> None:
    """Start a plugin: a package skeleton (component, tests with rlcli.testing, recipe) in a new folder."""


def _new(kind: str, name: str, folder: str | None) -> None:
    from rlcli.scaffold import ScaffoldError, write_package

    try:
        root, files = write_package(kind, name, folder)
    except ScaffoldError as exc:
        _fail(str(exc), EXIT_RECIPE_ERROR)
    recipe = next(p.relative_to(root) for p in files if p.suffix == ".yaml")
    click.echo(f"wrote {len(files)} files to {root}/\nnext, in {root}:\n"
               f"  pip install -e .           # then `rlcli plugins` lists it\n"
               f"  pytest                     # its tests, with the kit of rlcli.testing\n"
               f"  rlcli train {recipe}   # trains in seconds on the CPU")


_NAME_HELP = "NAME: lower-case letters, digits and - or _ (my-judger -> component my_judger, package rlcli-my-judger)."


@new.command("judger", help=f"Write a judger plugin package. {_NAME_HELP}")
@click.argument("name")
@click.option("--dir", "folder", type=click.Path(file_okay=False), help="Where (default: ./rlcli-NAME); new or empty.")
def new_judger(name: str, folder: str | None) -> None:
    _new("judger", name, folder)


@new.command("agent-loop", help=f"Write a multi-turn agent-loop plugin package (no tools). {_NAME_HELP}")
@click.argument("name")
@click.option("--dir", "folder", type=click.Path(file_okay=False), help="Where (default: ./rlcli-NAME); new or empty.")
def new_agent_loop(name: str, folder: str | None) -> None:
    _new("agent-loop", name, folder)


@cli.command()
@click.argument("work_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--out", type=click.Path(dir_okay=False),
              help="HTML file to write (default: the first WORK_DIR's report.html).")
def report(work_dirs: tuple[str, ...], out: str | None) -> None:
    """One self-contained HTML report of one run, or of several runs overlaid.

    \b
    examples:
      rlcli report work_dirs/quickstart                       # -> work_dirs/quickstart/report.html
      rlcli report runs/sync runs/async --out compare.html    # two runs on the same axes
    """
    from rlcli.report import ReportError
    from rlcli.report.html import write_report

    try:
        path = write_report([Path(w) for w in work_dirs], Path(out) if out else None)
    except ReportError as exc:
        _fail(str(exc), EXIT_RECIPE_ERROR)
    except OSError as exc:
        _fail(f"cannot write the report: {exc}", 1)
    click.echo(f"wrote {path}")


@cli.command("inspect")
@click.argument("work_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--step", type=int, help="Only this training step.")
@click.option("--task", help="Only this task.")
@click.option("--min-reward", type=float, help="Only rollouts with reward >= this.")
@click.option("--max-reward", type=float, help="Only rollouts with reward <= this.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many rows.")
@click.option("--full", is_flag=True, help="Whole prompts and responses (default: clipped at 300 characters).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line, for scripts.")
def inspect_cmd(work_dir: str, step: int | None, task: str | None, min_reward: float | None,
                max_reward: float | None, limit: int | None, full: bool, as_json: bool) -> None:
    """Browse the rollouts a run dumped to WORK_DIR/rollouts/ (paged on a terminal).

    \b
    examples:
      rlcli inspect work_dirs/quickstart --step 10 --min-reward 1
      rlcli inspect work_dirs/quickstart --max-reward 0 --json | jq .response
    """
    from rlcli.report.inspect import run_inspect

    run_inspect(Path(work_dir), step=step, task=task, min_reward=min_reward, max_reward=max_reward,
                limit=limit, as_json=as_json, full=full)


def main() -> None:
    try:
        cli()
    except SystemExit as exc:
        _exit_past_stray_threads(exc)
        raise
    _exit_past_stray_threads(SystemExit(0))


STRAY_GRACE_S = 5.0


def _exit_past_stray_threads(exc: SystemExit) -> None:
    """The command is done: if threads that are not rlcli's (a judger's, a plugin's) would keep the
    interpreter from exiting, wait ``STRAY_GRACE_S`` for them, then say which and exit without them.
    Thread pools' idle workers (``ThreadPoolExecutor-*``, rlcli's ``rlcli-*``) stop at exit: not stray."""
    import logging
    import threading
    import time

    stray = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
             and not t.name.startswith(("ThreadPoolExecutor-", "rlcli-"))]
    deadline = time.monotonic() + STRAY_GRACE_S
    for t in stray:
        t.join(max(0.0, deadline - time.monotonic()))
    stray = [t for t in stray if t.is_alive()]
    if not stray:
        return
    code = exc.code
    if isinstance(code, str):  # what SystemExit would have printed
        click.echo(code, err=True)
        code = 1
    names = ", ".join(t.name for t in stray)
    logging.getLogger("rlcli").warning("threads still running after the command finished (%s): not rlcli's (a "
                                       "judger's or a plugin's?); exiting without waiting for them", names)
    click.echo(f"rlcli: exiting without waiting for threads that are still running ({names}): not rlcli's; "
               "a judger or plugin that starts threads should make them daemons or stop them", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code or 0)


if __name__ == "__main__":
    main()
