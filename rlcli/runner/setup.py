"""A run's setup, shared by both runners and ``rlcli eval``: the work dir's default path (what may
be written there: :mod:`rlcli.runner.workdir`), logging and seeds, the :class:`Environment` (device,
dtype, model, tokenizer) that builds the inference backend and the train worker, the runtime
tasks, and the garbage-collector freeze of the start-up heap."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from rlcli.backends.base import BackendContext, InferenceBackend
from rlcli.component import Shardable
from rlcli.config import Recipe, TaskConfig, check_prompt_lengths, model_context, resolved_dict, task_max_tokens
from rlcli.data.base import DataError
from rlcli.data.sampler import RECIPE_DIR
from rlcli.dist import barrier, init_distributed, is_main, local_device
from rlcli.fsutil import write_text
from rlcli.models import prepare_model_dir, resolve_device, resolve_dtype, tokenizer_source
from rlcli.plugins import get_registry
from rlcli.produce import Task
from rlcli.produce.staleness import StalenessRule
from rlcli.runner.workload import rollout_workload
from rlcli.tokenizer import eos_token_ids, load_tokenizer

if TYPE_CHECKING:
    from rlcli.train.worker import TrainWorker

log = logging.getLogger("rlcli")


def default_work_dir(recipe: Recipe) -> Path:
    if recipe.trainer.work_dir:
        return Path(recipe.trainer.work_dir)
    stem = recipe._source.stem if recipe._source is not None else "run"
    return Path("work_dirs") / stem


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # pragma: no cover
        pass


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # our own progress bars only


def setup_logging(work_dir: Path | None, quiet: bool = False) -> None:
    quiet_transformers()
    root = logging.getLogger("rlcli")
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    if not quiet:
        sh = logging.StreamHandler()
        sh.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        sh.setLevel(logging.WARNING)
        root.addHandler(sh)
    if work_dir is not None:
        work_dir.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(work_dir / "run.log")
        fh.setFormatter(fmt)
        root.addHandler(fh)
    root.propagate = False


class Environment:
    """Device, dtype, model directory and tokenizer of a run, and the builders of its inference backend
    and train worker. It reads the recipe's ``resources``, ``model``, ``trainer.seed``, ``rollout`` and
    ``train_worker`` and keeps only those sections, plus what sizes the backend's workload
    (``trainer.train_batch_size``, the training tasks, ``eval.evaluator``)."""

    def __init__(self, recipe: Recipe, work_dir: Path):
        self.work_dir = work_dir
        self.model_cfg, self.rollout_spec, self.worker_cfg = recipe.model, recipe.rollout, recipe.train_worker
        quiet_transformers()
        if recipe._source is not None:
            RECIPE_DIR.set(recipe._source.resolve().parent)
        device = resolve_device(recipe.resources.device)
        self.rank, self.world_size = init_distributed(device)
        self.device = local_device(device)
        if self.device.type == "cpu" and recipe.resources.num_threads:
            torch.set_num_threads(recipe.resources.num_threads)
        self.dtype = resolve_dtype(recipe.model.dtype, self.device)
        self.seed = recipe.trainer.seed
        self._train_tasks, self._train_batch_size = recipe.tasks, recipe.trainer.train_batch_size
        self._evaluator = recipe.eval.evaluator if recipe.eval else None
        self._prepared: list[tuple[TaskConfig, Any]] = []  # the tasks this process rolls out (prepare_samplers)
        if is_main():  # rank 0 materialises a from-scratch model; the others read it
            self.model_dir = prepare_model_dir(recipe.model, work_dir, self.seed)
        barrier()
        if not is_main():
            self.model_dir = prepare_model_dir(recipe.model, work_dir, self.seed)
        self.tokenizer = load_tokenizer(tokenizer_source(recipe.model, self.model_dir))
        self.eos_ids = eos_token_ids(self.tokenizer, self.model_dir)
        if not self.eos_ids:
            raise ValueError(f"the tokenizer of {self.model_dir} defines no EOS token")
        self._samplers: dict[int, tuple[TaskConfig, Any]] = {}

    def prepare_samplers(self, task_cfgs: list[TaskConfig], *, trained: list[TaskConfig] = ()) -> list[tuple[str, Any]]:
        """Build the samplers of ``task_cfgs`` now, before any model loads, so that a dataset the run
        cannot use stops it first (``DataError``: no usable prompt, every prompt too long for the
        model, or, for the tasks this rank trains on (``trained``), a sequence longer than
        ``pack_max_length``); :func:`build_tasks` then takes these instead of building new ones.
        Returns ``(task name, sampler)`` pairs."""
        out, errors = [], []
        for tc in task_cfgs:
            sampler = tc.sampler.build(tokenizer=self.tokenizer, task_name=tc.task_name, seed=self.seed)
            self._samplers[id(tc)] = (tc, sampler)
            self._prepared.append((tc, sampler))
            out.append((tc.task_name, sampler))
            errors += self._check_prompts(tc, sampler, trains=any(tc is t for t in trained))
        if errors:
            raise DataError("\n".join(errors))
        return out

    def _check_prompts(self, tc: TaskConfig, sampler, *, trains: bool) -> list[str]:
        """Errors (warnings are logged) of ``tc``'s prompts against the model's context and a pack."""
        lengths = sampler.prompt_lengths()
        max_tokens = task_max_tokens(tc.agent_loop.cfg)
        if not lengths or max_tokens is None:
            return []
        context, src = model_context(self.model_cfg)
        pack = self.worker_cfg.pack_max_length if trains else None
        places = sampler.prompt_places() if hasattr(sampler, "prompt_places") else None  # third-party samplers may not
        errors, warnings = check_prompt_lengths(tc.task_name, lengths, max_tokens, context, src, pack, places)
        for w in warnings:
            log.warning("%s", w)
        return errors

    def take_sampler(self, tc: TaskConfig):
        """The sampler :meth:`prepare_samplers` built for ``tc``, else a new one."""
        owner, sampler = self._samplers.pop(id(tc), (None, None))
        if owner is tc:
            return sampler
        return tc.sampler.build(tokenizer=self.tokenizer, task_name=tc.task_name, seed=self.seed)

    def build_backend(self, version: int = 0, shard: tuple[int, int] | None = None) -> InferenceBackend:
        """The recipe's inference backend; ``shard=(index, replicas)`` when not every rank hosts one. Its
        context carries the workload of the tasks :meth:`prepare_samplers` prepared (call that first)."""
        index, replicas = shard if shard is not None else (self.rank, self.world_size)
        workload = rollout_workload(self._prepared, self._train_tasks, self._train_batch_size, self._evaluator,
                                    (index, replicas))
        ctx = BackendContext(
            model_dir=str(self.model_dir), device=self.device, dtype=self.dtype, eos_token_ids=self.eos_ids,
            pad_token_id=self.tokenizer.pad_token_id, seed=self.seed, version=version,
            rank=index, world_size=replicas, workload=workload,
        )
        return self.rollout_spec.build(ctx=ctx)

    def build_train_worker(self, total_steps: int, process_group=None) -> TrainWorker:
        """The trainer of ``recipe.model`` with ``recipe.train_worker`` (its loss included) on this rank's
        device; ``total_steps`` sizes the LR schedule, ``process_group`` the FSDP group (default: all ranks)."""
        from rlcli.train.worker import TrainWorker

        cfg = self.worker_cfg
        return TrainWorker(self.model_dir, self.model_cfg, cfg, cfg.loss.build(), device=self.device,
                           dtype=self.dtype, seed=self.seed, total_steps=total_steps, process_group=process_group)


def build_judge_pool(task_cfg: TaskConfig, where: str):
    """The judge pool of a task; a judger the default ``process`` executor cannot pickle raises
    :class:`~rlcli.judgers.pool.JudgerNotPicklable` naming ``<where>.judger``."""
    from rlcli.judgers.pool import JudgePool, JudgerNotPicklable

    try:
        return JudgePool(task_cfg.judger.build(), task=task_cfg.task_name)
    except JudgerNotPicklable as exc:
        raise JudgerNotPicklable(f"{where}.judger: {exc}") from exc.__cause__


def build_tasks(env: Environment, task_cfgs: list[TaskConfig], backend, *, salt: str, sync_weights_interval: int,
                eval_mode: bool = False, shard: tuple[int, int] | None = None):
    """Runtime :class:`Task` objects (and their judge pools) for a list of task configs.

    ``sync_weights_interval``: ``trainer.sync_weights_interval``, which the produce strategies are built with.
    ``shard=(index, count)``: this process's share of the prompts (default: its rank among all ranks).
    """
    interval = sync_weights_interval
    index, count = shard if shard is not None else (env.rank, env.world_size)
    tasks, pools = [], []
    for i, tc in enumerate(task_cfgs):
        pool = build_judge_pool(tc, f"{'eval.tasks' if eval_mode else 'tasks'}.{i}")
        pools.append(pool)
        sampler = env.take_sampler(tc)
        if isinstance(sampler, Shardable):
            sampler.shard(index, count)  # every rank rolls out distinct prompts
        loop = tc.agent_loop.build(backend=backend, judge_pool=pool, tokenizer=env.tokenizer,
                                   eos_token_ids=env.eos_ids, seed=env.seed, salt=f"{salt}:{tc.task_name}")
        strategy = tc.produce_strategy.build(sync_weights_interval=interval)
        filters = [] if eval_mode else [f.build() for f in tc.group_filters]
        rule = strategy.staleness_rule() if not eval_mode else StalenessRule()
        tasks.append(Task(tc.task_name, tc.weight, sampler, loop, strategy, filters, rule))
    return tasks, pools


RESOLVED = "resolved.yaml"  # <work_dir>/resolved.yaml: the recipe as run, its plugins and versions


def write_resolved(recipe: Recipe, work_dir: Path) -> None:
    reg = recipe._registry or get_registry()
    used = {}
    for path, kind, spec in recipe.components():
        e = reg.entry(kind, spec.name)
        used[path] = f"{kind} {spec.name} from {e.dist} {e.version}"
    data = {"recipe": resolved_dict(recipe), "plugins": used,
            "versions": {"torch": str(torch.__version__), "transformers": str(__import__("transformers").__version__)}}
    work_dir.mkdir(parents=True, exist_ok=True)
    write_text(work_dir / RESOLVED, yaml.safe_dump(data, sort_keys=False))


def freeze_heap() -> None:
    """Exempt everything built so far (modules, models, tokenizer: ~400k objects) from the cyclic
    garbage collector. Otherwise each full collection scans them all - about 0.2 s on a small CPU,
    every few steps - and stalls the event loop that feeds the engine, or the trainer."""
    import gc

    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo :func:`freeze_heap` when a runner closes. Frozen objects are never collected, so a
    closed runner's trainer, engine and their device memory (GiBs: weights, Adam state, KV
    cache) would otherwise stay allocated for the life of the process as soon as anything
    reaches them through a reference cycle - a second run in the same process, a notebook."""
    import gc

    gc.unfreeze()
    gc.collect()
