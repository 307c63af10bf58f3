"""The colocated GRPO runner: rollout and training take turns on the same devices.

    sampler -> agent loop -> backend -> judger -> produce strategy -> replay buffer
        -> advantages -> GRPO loss -> optimizer step -> weight sync -> eval / checkpoint / log
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rlcli.component import AcceptsLiveWeights
from rlcli.config import Recipe
from rlcli.dist import barrier, init_distributed
from rlcli.produce.manager import RolloutManager
from rlcli.models import resolve_device
from rlcli.fsutil import write_jsonl
from rlcli.runner import expandable_segments
from rlcli.runner.evaluation import Evaluator
from rlcli.runner.ranks import gather_to_main, merge_metrics
from rlcli.runner.records import (
    ROLLOUT_TOKENS_PER_S, Timer, add_train_throughput, best_and_worst, build_trackers, dump_rollout_groups,
    log_to_trackers, mean, per_second, prune_step_dirs, sample_row, step_summary, write_skipped_rows,
)
from rlcli.runner.schedule import Schedule, share, total_train_steps
from rlcli.runner.sequences import sequences_from_groups
from rlcli.runner.setup import (
    Environment, build_tasks, default_work_dir, freeze_heap, seed_everything, setup_logging, thaw_heap,
    write_resolved,
)
from rlcli.runner.workdir import export_missing, mark_finished, note_recipe_changes, prepare_work_dir, recipe_record
from rlcli.stall import StallWatchdog

log = logging.getLogger("rlcli")


class ColocateRunner:
    """One rank of a colocated run (rank 0 also owns the console, logs and checkpoint metadata).

    Every rank hosts an inference replica and rolls out its share of ``train_batch_size`` from
    its shard of the prompts; advantages are computed per group on the rank that produced it,
    and FSDP2 trains on all ranks' sequences with the loss normalised over the whole step.
    """

    def __init__(self, recipe: Recipe, work_dir: str | Path | None = None, *, quiet: bool = False,
                 overwrite: bool = False):
        self.recipe, self.cfg = recipe, recipe.trainer
        self.work_dir = Path(work_dir) if work_dir else default_work_dir(recipe)
        device = resolve_device(recipe.resources.device)
        self._restore_allocator = expandable_segments.apply(recipe.resources.expandable_segments,
                                                            recipe.rollout.cls, device)
        try:
            self._build(recipe, device, quiet, overwrite)
        except BaseException:  # a run that never starts leaves the process's allocator as it found it
            self._restore_allocator()
            raise

    def _build(self, recipe: Recipe, device: torch.device, quiet: bool, overwrite: bool) -> None:
        from rlcli.train.checkpoint import latest_checkpoint

        rank, world = init_distributed(device)
        self.main, self.quiet = rank == 0, quiet or rank != 0
        ckpt = None
        if self.main:  # rank 0 decides between resuming and starting fresh (and cleans up)
            ckpt = prepare_work_dir(self.work_dir, auto_resume=self.cfg.auto_resume, overwrite=overwrite)
            setup_logging(self.work_dir, quiet)
            write_resolved(recipe, self.work_dir)
        barrier()
        if not self.main and self.cfg.auto_resume and not overwrite:
            ckpt = latest_checkpoint(self.work_dir / "checkpoints")
        seed_everything(self.cfg.seed + rank)
        self.env = env = Environment(recipe, self.work_dir)
        self.schedule = Schedule.of(self.cfg, recipe.eval, total_train_steps(self.cfg, recipe.tasks, env.tokenizer))
        # the data before any model: a dataset without a usable prompt stops the run here
        samplers = env.prepare_samplers(
            recipe.tasks + (recipe.eval.tasks if self.schedule.evaluate else []), trained=recipe.tasks)
        if self.main:
            write_skipped_rows(self.work_dir, samplers)
        self.local_batch = share(self.cfg.train_batch_size, rank, world)  # this rank's groups of every step
        if self.local_batch == 0:
            raise ValueError(f"trainer.train_batch_size={self.cfg.train_batch_size} is smaller than the "
                             f"number of ranks ({world}); every rank needs at least one group")
        self.timer = Timer()
        self.trackers = build_trackers(self.cfg.exp_tracker, self.work_dir, recipe._registry) if self.main else []
        self.worker = env.build_train_worker(self.schedule.total_steps)
        self.estimator = recipe.advantage.build()
        self.backend = env.build_backend()
        interval = self.cfg.sync_weights_interval
        tasks, pools = build_tasks(env, recipe.tasks, self.backend, salt="train", sync_weights_interval=interval)
        self.manager = RolloutManager(tasks, recipe.replay_buffer.build(), self.backend, pools)
        use_lockstep = getattr(self.backend, "use_lockstep", None)  # engines that can (the embedded one)
        if use_lockstep is not None:
            use_lockstep(any(t.strategy.lockstep for t in tasks))
        self.evaluator = (Evaluator(env, recipe.eval, self.backend, sync_weights_interval=interval)
                          if self.schedule.evaluate else None)
        self.loop = asyncio.new_event_loop()
        self.watchdog = StallWatchdog(self.loop)  # a rollout that stops moving says where
        self.step = 0
        if ckpt is not None:
            self._resume(ckpt)
        self.sync_weights(version=self.step)  # the backend serves exactly the trainer's weights
        freeze_heap()
        self.watchdog.start()

    def peak_memory_gib(self) -> tuple[float, float] | None:
        """Peak device memory allocated, and reserved by torch's caching allocator, by this process since
        the last call (GiB); None on CPU. Reserved beyond allocated is what the allocator holds unused
        (cached or fragmented: resources.expandable_segments)."""
        dev = self.env.device
        if dev.type != "cuda":
            return None
        peaks = torch.cuda.max_memory_allocated(dev) / 2**30, torch.cuda.max_memory_reserved(dev) / 2**30
        torch.cuda.reset_peak_memory_stats(dev)
        return round(peaks[0], 3), round(peaks[1], 3)

    # ----------------------------------------------------------------------------------- loop
    def fit(self) -> dict[str, float]:
        last: dict[str, float] = {}
        if export_missing(self.work_dir, self.step, self.schedule):  # killed while writing it: resumed, redo it
            self.export_hf(self.step)
        if self.schedule.initial_eval_due(self.step):
            last = self.evaluate(0)
            self.log(0, last)
        bar = tqdm(total=self.schedule.total_steps, initial=self.step, desc="train", unit="step",
                   disable=self.quiet, dynamic_ncols=True)
        while self.step < self.schedule.total_steps:
            step, t0 = self.step + 1, time.perf_counter()
            policy = self.schedule.model_step(step)  # the weights the backend serves for this step
            with self.timer("rollout"), self.bar(f"rollout {step}", self.local_batch, "group") as tick:
                # sampler -> agent loop -> backend -> judger -> produce strategy -> replay buffer
                batch = self.run(self.manager.produce_batch(self.local_batch, step, policy, tick))
            rollout_peak = self.peak_memory_gib()
            with self.timer("sleep"):  # colocated: give the KV cache back for training
                self.backend.sleep()
            with self.timer("train"):  # advantages -> sequences -> GRPO loss -> optimizer step(s)
                with torch.profiler.record_function("rlcli/train/sequences"):
                    seqs, adv = sequences_from_groups(batch.groups, self.estimator, self.worker.vocab_size)
                metrics = {**batch.metrics, **self.worker.train_step(seqs), "advantage/mean": mean(adv)}
            if rollout_peak is not None:
                metrics["memory/rollout_peak_gib"], metrics["memory/rollout_reserved_peak_gib"] = rollout_peak
                metrics["memory/train_peak_gib"], metrics["memory/train_reserved_peak_gib"] = self.peak_memory_gib()
            self.step = step
            if self.schedule.sync_due(step):
                with self.timer("sync"):
                    self.sync_weights(version=step)
            with self.timer("wake_up"):  # engines that rebuild their KV cache (and graphs) spend it here
                self.backend.wake_up()
            if self.schedule.eval_due(step):
                metrics.update(self.evaluate(step))
            metrics["timing/step_s"] = time.perf_counter() - t0
            self.dump_rollouts(step, batch.groups)
            last = self.log(step, metrics, batch.groups)
            self.maybe_save(step)  # after the step's row is logged: a resume never loses it
            bar.update(1)
            bar.set_postfix_str(self.summary(last), refresh=False)
        bar.close()
        if self.main:
            mark_finished(self.work_dir, self.step, self.recipe)
        return last

    # ------------------------------------------------------------------------------- phases
    def run(self, coro):
        return self.loop.run_until_complete(coro)

    @contextlib.contextmanager
    def bar(self, desc: str, total: int, unit: str):
        """A progress bar that appears only when the phase takes more than two seconds."""
        with tqdm(total=total, desc=desc, unit=unit, leave=False, delay=2.0, disable=self.quiet,
                  dynamic_ncols=True) as b:
            yield b.update

    def sync_weights(self, version: int) -> None:
        """Stream the trainer's weights to the backend bucket by bucket (no full copy, no disk).
        A backend that copies and casts them itself (``accepts_live_weights``) gets the trainer's
        own parameters, with no cast copy in between, where the trainer holds them whole."""
        live = (isinstance(self.backend, AcceptsLiveWeights) and bool(self.backend.accepts_live_weights)
                and self.worker.can_lend_weights())
        itemsize = self.worker.dtype.itemsize
        nbytes, seen = 0, set()
        for bucket in self.worker.iter_weights(live=live):
            # counted once per tensor (tied weights come under two names) and in the run dtype (the
            # backend's copy), whatever the tensors handed over are in
            for _, t in bucket:
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    nbytes += t.numel() * (itemsize if t.is_floating_point() else t.element_size())
            self.backend.update_weights(bucket, version)
        self.sync_bytes = nbytes

    def evaluate(self, step: int) -> dict[str, float]:
        """Every rank evaluates its share of the eval prompts; rank 0 reduces and writes them."""
        with self.timer("eval"), self.bar(f"eval {step}", self.evaluator.num_groups(), "prompt") as tick:
            samples = self.run(self.evaluator.run(step, tick))
            stats = self.evaluator.pop_stats()
        gathered = gather_to_main((samples, stats))
        if not self.main:
            return {}
        everything = sorted((s for part, _ in gathered for s in part), key=lambda s: (s.task_name, s.uid))
        metrics = self.evaluator.metrics(everything)
        for _, stats in gathered:
            for k, v in stats.items():
                metrics[k] = metrics.get(k, 0.0) + v
        write_jsonl(self.work_dir / "eval" / f"step-{step}.jsonl", [sample_row(s) for s in everything])
        return metrics

    def dump_rollouts(self, step: int, groups) -> None:
        """A bounded sample of the step's rollouts: half the best groups and half the worst, by mean reward."""
        n = self.cfg.dump_rollout_groups
        if n <= 0:
            return
        gathered = gather_to_main(best_and_worst(groups, n))  # each rank sends only its candidates
        if not self.main:
            return
        dump_rollout_groups(self.work_dir, step, [g for part in gathered for g in part], n)

    def maybe_save(self, step: int) -> None:
        if self.schedule.checkpoint_due(step):
            with self.timer("checkpoint"):
                self.save_checkpoint(step)
        if self.schedule.hf_export_due(step):
            with self.timer("hf_export"):
                self.export_hf(step)

    def export_hf(self, step: int) -> None:
        """``hf/step-N`` (collective; rank 0 writes), then the oldest beyond ``hf_maxkeep`` go."""
        self.worker.save_hf(self.work_dir / "hf" / f"step-{step}", self.env.tokenizer)
        if self.main:
            prune_step_dirs(self.work_dir / "hf", self.cfg.hf_maxkeep)

    def save_checkpoint(self, step: int) -> None:
        """Collective: DCP shards from every rank, each rank's rollout state gathered into rank 0's file."""
        from rlcli.train.checkpoint import prune

        managers = gather_to_main(self.manager.state_dict())
        extra = {"step": step, "managers": managers, "recipe": recipe_record(self.recipe)}
        self.worker.save_checkpoint(self.work_dir / "checkpoints" / f"step-{step}", extra,
                                    no_optimizer=self.cfg.checkpoint_no_save_optimizer)
        if self.main:
            prune(self.work_dir / "checkpoints", self.cfg.checkpoint_maxkeep)
        barrier()

    def _resume(self, path: Path) -> None:
        extra = self.worker.load_checkpoint(path)
        managers = extra["managers"]
        if len(managers) != self.env.world_size:
            raise RuntimeError(f"{path} was written by {len(managers)} rank(s); resume it with the same "
                               f"number of ranks (this run has {self.env.world_size})")
        self.step = int(extra["step"])
        self.manager.load_state_dict(managers[self.env.rank])
        for t in self.trackers:
            t.truncate_after(self.step)
        log.info("resumed from %s at step %d", path, self.step)
        if not self.quiet:
            print(f"resumed from {path} (step {self.step})")
        if self.main:
            note_recipe_changes(extra.get("recipe"), self.recipe, path)

    # ------------------------------------------------------------------------------ logging
    def log(self, step: int, metrics: dict[str, float], groups=None) -> dict[str, float]:
        """Merge every rank's metrics on rank 0 and hand them to the trackers; returns the merged row."""
        timing = {"timing/rollout_s": 0.0, "timing/train_s": 0.0, "timing/sync_s": 0.0, **self.timer.pop()}
        metrics = {**metrics, **timing}
        if timing["timing/sync_s"] > 0:
            metrics["sync/bytes"] = float(self.sync_bytes)
        if "rollout/tokens" in metrics:  # this rank's rate; merge_metrics sums the ranks'
            metrics[ROLLOUT_TOKENS_PER_S] = per_second(metrics["rollout/tokens"], timing["timing/rollout_s"])
        gathered = gather_to_main(metrics)
        if not self.main:
            return metrics
        metrics = {**merge_metrics(gathered), "time": time.time()}
        add_train_throughput(metrics)
        log_to_trackers(self.trackers, step, metrics, groups, self.cfg.log_samples_per_step)
        if step % self.cfg.log_every == 0 and not self.quiet:
            tqdm.write(f"step {step}/{self.schedule.total_steps} {self.summary(metrics)}")
        return metrics

    @staticmethod
    def summary(m: dict[str, float]) -> str:
        return step_summary(m)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
        for p in self.manager.judge_pools:
            p.close()
        if self.evaluator:
            self.evaluator.close()
        self.backend.shutdown()
        # A pause can leave the backend's driver task waiting on its last engine step when a
        # step's rollout returns; finish such tasks so closing the loop does not destroy them.
        leftover = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for t in leftover:
            t.cancel()
        if leftover:
            self.loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
        self.watchdog.stop()
        self.loop.close()
        thaw_heap()
        self._restore_allocator()


def run_training(recipe: Recipe, work_dir: str | Path | None, *, quiet: bool = False,
                 overwrite: bool = False) -> tuple[Path, dict[str, float]]:
    """Build the runner, train, clean up; returns the work dir and the last step's metrics."""
    runner = ColocateRunner(recipe, work_dir, quiet=quiet, overwrite=overwrite)
    try:
        return runner.work_dir, runner.fit()
    finally:
        runner.close()
