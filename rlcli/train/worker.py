"""The train worker: an HF causal LM under FSDP2, trained with a registered policy loss.

One ``TrainWorker`` per rank (a single process is a one-rank group: FSDP2 is always used).
:meth:`TrainWorker.train_step` runs one RL step on this rank's sequences::

    split into optimizer_steps mini-batches (contiguous, token-balanced)
    pack every mini-batch (<= pack_max_length tokens per micro-batch)
    old logprobs: a no-grad pass when optimizer_steps > 1 or when rollout IS may drop tokens;
                  otherwise the detached current logprobs (the ratio is exactly 1 at the first
                  and only update)
    rollout IS (train_worker.rollout_is): weights / dropped tokens from old - rollout logprobs
    reference logprobs (train_worker.kl.coef > 0): a no-grad pass of the frozen initial policy
    for each mini-batch: forward/backward every micro-batch, loss weighted by 1 / (kept tokens
                  of the mini-batch on all ranks) x IS weight, plus coef x KL(policy || ref) with
                  the same token weights; clip; optimizer step unless the loss or the grad norm
                  is not finite; LR scheduler step

With ``kl.coef == 0`` and ``rollout_is`` null none of the optional passes runs.

Log-probs and entropies are computed from ``logits / temperature`` (per sequence) by the fused,
chunked ``lm_head`` + ``log_softmax`` of :mod:`rlcli.train.logprobs`; when every token's loss
gradient is known before the forward pass (``head_grad_in_forward``; see
:func:`rlcli.train.step_loss.head_grad_ahead`) the head's gradient is computed during the
forward pass. The loss of a micro-batch is put together in :mod:`rlcli.train.step_loss`.
Clipping and the AdamW step run on the local shards (:mod:`rlcli.train.optim`); FSDP2 wrapping
is :mod:`rlcli.train.fsdp`, weight export and HF model dirs :mod:`rlcli.train.weights`.

Ranks: every rank runs the same number of micro-batches per mini-batch (short ranks run empty
ones), token/sequence counts and metrics are all-reduced, and the loss is scaled by the world
size because FSDP averages gradients while the loss is already normalised globally. On a single
rank, micro-batches of a mini-batch accumulate gradients without FSDP's per-micro-batch
reduce-scatter/re-gather copies (free there; see ``_accumulating``).

Dropout: forwards with gradients run in ``train()`` mode, no-grad forwards in ``eval()`` mode;
they agree for the dropout-free decoders RL fine-tunes (Qwen, Llama, ...).

Reference model (KL penalty): the initial policy, read again from ``model_dir`` on the first step
that needs it (a worker that only evaluates never loads it) directly in the FSDP compute dtype,
frozen and sharded like the policy; with ``kl.ref_offload`` on CUDA its shards stay in CPU memory
and each layer is brought to the GPU only for its forward. It is never saved in checkpoints: a
resumed run reads the same weights from the same directory.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlcli.algo.mismatch import RolloutCorrection, can_reject, finalize_metrics
from rlcli.dist import device_mesh, group_mesh, init_distributed, local_device
from rlcli.models import resolve_dtype
from rlcli.train import checkpoint as ckpt
from rlcli.train import fsdp, lora, weights
from rlcli.train.attention import use_shared_prompt_attention
from rlcli.train.data import (
    LayoutCost,
    LazyList,
    MicroBatch,
    TrainSequence,
    build_micro_batch,
    choose_layout,
    empty_micro_batch,
    pack_balanced,
    pack_shared,
    split_minibatches,
)
from rlcli.train.divergence import check_finite
from rlcli.train.logprobs import PolicyModel, chunked_logprobs, head_value_and_grad_ahead  # noqa: F401 (re-exported)
from rlcli.train.lr import build_scheduler
from rlcli.train.optim import MomentDtypeAdamW, adamw_step_local, clip_grad_norm_local
from rlcli.train.step_loss import correction, head_grad_ahead, kept_counts, micro_batch_loss, on_policy_grad
from rlcli.train.step_metrics import StepMetrics
from rlcli.train.weights import DEFAULT_BUCKET_BYTES

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from rlcli.algo.loss import PolicyLoss
    from rlcli.config import ModelConfig, TrainWorkerConfig


@dataclass
class _Step:
    """One train step as its mini-batches share it: the packed micro-batches, what the passes
    before the first update computed, the global counts that normalise the loss, and the results
    of each update."""

    batches: list[LazyList[MicroBatch]]
    metrics: StepMetrics
    old: list[list[torch.Tensor]] | None  # per mini-batch and micro-batch; None: each update's own
    corr: list[list[RolloutCorrection]] | None  # rollout IS from the old pass; None: computed per micro-batch
    ref: list[list[torch.Tensor]] | None  # reference logprobs (KL penalty)
    num_tokens: list[int]  # per mini-batch, over all ranks: the tokens rollout IS kept
    num_seqs: list[int]  # per mini-batch, over all ranks: the sequences with a kept token
    ahead: bool  # the head's gradient computed in the forward pass (see step_loss.head_grad_ahead)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    skipped: int = 0


# ------------------------------------------------------------------------------ worker
class TrainWorker:
    """FSDP2 policy trainer for one rank: train steps, logprobs, weight export, checkpoints.

    ``model_dir``: an HF causal-LM directory, loaded with float32 master weights. ``dtype``: the
    run dtype (FSDP param dtype when ``fsdp.param_dtype`` is auto; default from
    ``model_cfg.dtype``). ``total_steps``: RL steps of the run; the LR schedule spans
    ``total_steps × optimizer_steps`` optimizer steps. Every public method is collective.

    ``process_group``: the ranks this worker trains with (default: every rank of the job). FSDP2
    shards over exactly these ranks and every reduction, barrier and "rank 0 writes" decision of
    training, weight export and HF export stays inside the group, so other ranks (e.g. the
    rollout ranks of a disaggregated run) are free meanwhile. Checkpoints
    (:meth:`save_checkpoint`, :meth:`load_checkpoint`) remain collective over the whole job:
    ranks outside the group join them with a stand-in module of their own (as the rollout ranks of
    ``rlcli.runner.disaggregated`` do).
    """

    def __init__(
        self,
        model_dir: str | Path,
        model_cfg: ModelConfig,
        cfg: TrainWorkerConfig,
        policy_loss: PolicyLoss,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        seed: int = 0,
        total_steps: int = 1,
        process_group: dist.ProcessGroup | None = None,
    ):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.model_cfg = model_cfg
        self.policy_loss = policy_loss
        self.device = torch.device(device)
        self.rank, self.world_size = init_distributed(self.device)
        self.group = process_group
        if process_group is not None:
            self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
            if self.rank < 0:
                raise ValueError("this process is not a member of the TrainWorker's process_group")
        self.device = local_device(self.device)
        self.mesh = device_mesh(self.device) if process_group is None else group_mesh(process_group, self.device)
        self.dtype = dtype if dtype is not None else resolve_dtype(getattr(model_cfg, "dtype", "auto"), self.device)
        self.total_optimizer_steps = max(1, total_steps) * cfg.optimizer_steps
        torch.manual_seed(seed)  # the torch generator drives any dropout; saved/restored by checkpoints

        self.model_dir = Path(model_dir)
        self.ref_model: PolicyModel | None = None  # frozen initial policy, built on first use (KL)
        self.hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                             trust_remote_code=False)
        self.hf_model.config.use_cache = False
        if cfg.share_prompts:
            use_shared_prompt_attention(self.hf_model)
        self.pad_id = self.hf_model.config.pad_token_id or 0
        self.layout_cost = LayoutCost.from_config(self.hf_model.config)
        self.tied = bool(getattr(self.hf_model.config, "tie_word_embeddings", False))
        if cfg.gradient_checkpointing:
            kwargs = {"use_reentrant": False}  # the reentrant variant does not compose with FSDP2
            if hasattr(self.hf_model, "activation_checkpointing_enable"):  # transformers >= 5.x
                self.hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # LoRA: adapters added (torch's generator, seeded above, initialises them) and the rest frozen
        self.adapters = lora.add_adapters(self.hf_model, model_cfg.lora) if getattr(model_cfg, "lora", None) else None
        self.model = PolicyModel(self.hf_model, cfg.logprob_chunk_size, cfg.fused_logprob)
        self._shard(self.model, cpu_offload=cfg.fsdp.cpu_offload)
        self.model.train()

        opt = cfg.optimizer
        params = [p for p in self.model.parameters() if p.requires_grad]
        if opt.moment_dtype == "float32":
            # The fused kernel (CPU and CUDA, DTensor-aware) is the fastest here: ~30% less step time on CPU.
            self.optimizer = torch.optim.AdamW(
                params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay, fused=True
            )
        else:
            self.optimizer = MomentDtypeAdamW(params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                              weight_decay=opt.weight_decay, moment_dtype=fsdp.DTYPES[opt.moment_dtype])
        self.scheduler = build_scheduler(self.optimizer, cfg.lr_scheduler, self.total_optimizer_steps)

    # -------------------------------------------------------------------------- setup
    @property
    def param_dtype(self) -> torch.dtype:
        """The FSDP compute dtype of the decoder (the run dtype unless ``fsdp.param_dtype`` is set)."""
        fs = self.cfg.fsdp
        return self.dtype if fs.param_dtype == "auto" else fsdp.DTYPES[fs.param_dtype]

    def _shard(self, model: PolicyModel, cpu_offload: bool) -> None:
        fsdp.shard(model, self.cfg.fsdp, self.mesh, self.device, self.param_dtype, cpu_offload)

    def _reference(self) -> PolicyModel:
        """The frozen reference policy (see the module docstring), built on the first call. Collective."""
        if self.ref_model is None:
            from transformers import AutoModelForCausalLM

            # Loading must not advance the RNG streams that checkpoints save and restore: a resumed
            # run builds the reference at a different step than the uninterrupted one.
            cuda = [self.device.index or 0] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):
                lm = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=self.param_dtype,
                                                          trust_remote_code=False)
            lm.config.use_cache = False
            if self.cfg.share_prompts:
                use_shared_prompt_attention(lm)
            lm.requires_grad_(False)
            ref = PolicyModel(lm, self.cfg.logprob_chunk_size, self.cfg.fused_logprob)
            self._shard(ref, cpu_offload=self.cfg.kl.ref_offload)
            ref.eval()
            self.ref_model = ref
        return self.ref_model

    # ------------------------------------------------------------------------ batches
    def _micro_batches(self, seqs: list[TrainSequence], groups: list[list[int]]) -> list[LazyList[MicroBatch]]:
        """Pack each index group; every rank gets the same number of micro-batches per group.

        A micro-batch's tensors are built (and copied to the device) when it is first used, so
        that building the next one can overlap the device's work on the previous one instead of
        holding up the first forward (six 32k-token packs built up front: 23 ms of host time under
        torch.profiler on the H200, the GPU idle for 17 ms of it)."""
        packer = pack_shared if self.cfg.share_prompts else pack_balanced
        packs = [packer(seqs, self.cfg.pack_max_length, g) for g in groups]
        counts = [len(p) for p in packs]
        if self.world_size > 1:
            t = torch.tensor(counts, dtype=torch.long, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            counts = t.tolist()
        out = []
        for group_packs, n in zip(packs, counts):
            makers = [functools.partial(self._build_micro_batch, seqs, p) for p in group_packs]
            makers += [functools.partial(self._build_micro_batch, seqs, None)] * (n - len(makers))
            out.append(LazyList(makers))
        return out

    def _build_micro_batch(self, seqs: list[TrainSequence], pack) -> MicroBatch:
        mb = (build_micro_batch(seqs, pack, self._layout(pack.lengths), self.pad_id) if pack is not None
              else empty_micro_batch(self.pad_id))
        return mb.to(self.device)

    def _layout(self, lengths: list[int]):
        if self.cfg.share_prompts:
            return "shared"
        forced = getattr(self.cfg, "pack_layout", "auto")
        if forced in ("packed", "padded"):
            return forced
        return choose_layout(lengths, self.cfg.pack_max_length, self.layout_cost)

    def _forward(self, mb: MicroBatch, with_entropy: bool = True, model: PolicyModel | None = None,
                 grad_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        inv_t = None if mb.unit_temperature else mb.inv_temperature
        return (model or self.model)(mb.input_ids, mb.position_ids, mb.label_index, mb.labels, inv_t, with_entropy,
                                     mb.attn_rows, mb.attn_owner, grad_logp)

    def _all_sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    @torch.no_grad()
    def _old_logprobs(self, batches: list[list[MicroBatch]], m: StepMetrics) -> list[list[torch.Tensor]]:
        """Log-probs of every micro-batch under the current weights (no grad); records the entropy."""
        old = []
        self.model.eval()
        try:
            for mbs in batches:
                row = []
                for mb in mbs:
                    logp, ent = self._forward(mb)
                    row.append(logp)
                    m.add_sum("entropy", ent.sum(), mb.num_labels)
                old.append(row)
        finally:
            self.model.reshard()
            self.model.train()
        return old

    @torch.no_grad()
    def _reference_logprobs(self, batches: list[list[MicroBatch]]) -> list[list[torch.Tensor]]:
        """Log-probs of every micro-batch under the frozen reference policy. Collective."""
        ref = self._reference()
        try:
            return [[self._forward(mb, with_entropy=False, model=ref)[0] for mb in mbs] for mbs in batches]
        finally:
            ref.reshard()

    # -------------------------------------------------------------------------- train
    def train_step(self, seqs: list[TrainSequence]) -> dict[str, float]:
        """One RL step on this rank's sequences (collective). Returns ``train/*`` and ``mismatch/*``
        metrics (global); the engine-trainer mismatch is measured whether or not ``rollout_is``
        corrects for it."""
        t0 = time.perf_counter()
        groups = split_minibatches([s.num_tokens for s in seqs], self.cfg.optimizer_steps)
        # Sequences without a trained token change nothing: leave them out of the forwards.
        groups = [[i for i in g if seqs[i].num_valid > 0] for g in groups]
        with torch.profiler.record_function("rlcli/train/pack"):  # a named range in profiler traces
            batches = self._micro_batches(seqs, groups)
        step = self._prepare_step(seqs, groups, batches)
        for j in range(len(batches)):
            local_loss = self._mini_batch_backward(step, j)
            with torch.profiler.record_function("rlcli/train/optimizer"):
                self._optimizer_step(step, j, local_loss)
            self._scheduler_step()
        if step.skipped:  # a NaN loss or gradient: a bad batch, or weights already ruined (diverged)
            log.warning("train step: %d update(s) skipped for a non-finite loss or gradient norm", step.skipped)
            self._check_finite("at a step whose loss or gradient was not finite")
        return self._step_metrics(step, t0)

    def _check_finite(self, when: str) -> None:
        """:class:`rlcli.train.divergence.DivergedError` if a weight is NaN or inf. Collective."""
        check_finite(self.model.parameters(), when, self.optimizer_steps_done, self.group, self.device)

    def _prepare_step(self, seqs: list[TrainSequence], groups: list[list[int]],
                      batches: list[LazyList[MicroBatch]]) -> _Step:
        """The passes before the first update (old logprobs and rollout IS where needed, reference
        logprobs for the KL penalty) and the global counts of every mini-batch."""
        is_cfg = self.cfg.rollout_is
        m = StepMetrics(self.device)
        # Old logprobs are needed up front when the policy moves within the step, and when rollout
        # IS may drop tokens (the loss normaliser counts kept tokens only). Otherwise the first and
        # only update's old logprobs are its own detached logprobs, and IS weights come from them.
        old: list[list[torch.Tensor]] | None = None
        corr: list[list[RolloutCorrection]] | None = None
        if self.cfg.optimizer_steps > 1 or can_reject(is_cfg):
            old = self._old_logprobs(batches, m)
            if is_cfg is not None:
                corr = [[correction(mb, lp, is_cfg, m) for mb, lp in zip(mbs, row)]
                        for mbs, row in zip(batches, old)]
        ref = self._reference_logprobs(batches) if self.cfg.kl.coef > 0 else None
        num_tokens, num_seqs = self._global_counts(seqs, groups, batches, corr)
        return _Step(batches, m, old, corr, ref, num_tokens, num_seqs, head_grad_ahead(self.cfg, self.policy_loss))

    def _global_counts(self, seqs: list[TrainSequence], groups: list[list[int]], batches: list[LazyList[MicroBatch]],
                       corr: list[list[RolloutCorrection]] | None) -> tuple[list[int], list[int]]:
        """Per mini-batch, summed over the ranks: the tokens and sequences that normalise the loss."""
        if corr is not None and can_reject(self.cfg.rollout_is):
            tok_counts, seq_counts = kept_counts(batches, corr, self.device)
        else:
            # what the micro-batches will hold, known without building them (groups keep only
            # sequences with a trained token)
            tok_counts = [float(sum(seqs[i].num_valid for i in g)) for g in groups]
            seq_counts = [float(len(g)) for g in groups]
        counts = self._all_sum(tok_counts + seq_counts)
        k = self.cfg.optimizer_steps
        return [int(c) for c in counts[:k]], [int(c) for c in counts[k:]]

    def _mini_batch_backward(self, step: _Step, j: int) -> torch.Tensor:
        """Forward and backward passes of every micro-batch of mini-batch ``j``, their gradients
        accumulating; returns this rank's part of the mini-batch loss (a float32 device scalar)."""
        mbs = step.batches[j]
        local_loss = torch.zeros((), dtype=torch.float32, device=self.device)
        for mi, mb in enumerate(mbs):
            self._accumulating(mi < len(mbs) - 1)
            local_loss += self._micro_batch_backward(step, j, mi, mb)
        return local_loss

    def _micro_batch_backward(self, step: _Step, j: int, mi: int, mb: MicroBatch) -> torch.Tensor:
        """Forward pass, loss and backward pass of micro-batch ``mi`` of mini-batch ``j``; adds its
        metrics to the step's and returns its loss (detached)."""
        m = step.metrics
        if step.ahead:  # the head's gradient is computed in the forward pass; logp, ent carry none
            g = on_policy_grad(self.policy_loss, mb, step.num_tokens[j], step.num_seqs[j], self.world_size, self.device)
            head_value, logp, ent = self._forward(mb, grad_logp=g)
        else:  # the entropy comes from the old pass when there is one, unless the loss needs it
            logp, ent = self._forward(mb, with_entropy=step.old is None or self.cfg.entropy_coef > 0)
        # k == 1: the weights have not moved since any old pass, so the ratio is exactly 1.
        old_logp = step.old[j][mi] if self.cfg.optimizer_steps > 1 else logp.detach()
        c = step.corr[j][mi] if step.corr is not None else correction(mb, old_logp, self.cfg.rollout_is, m)
        ref_logp = step.ref[j][mi] if step.ref is not None else None
        loss, metrics, n_kept = micro_batch_loss(self.cfg, self.policy_loss, mb, logp, old_logp, ent, c, ref_logp,
                                                 (step.num_tokens[j], step.num_seqs[j]), m)
        # The weights already normalise by the global count, but FSDP averages gradients over
        # ranks: scale by the world size so the update is the gradient of the global loss.
        if step.ahead:  # its gradient is that of the scaled loss (computed by on_policy_grad)
            head_value.backward()
        else:
            (loss * self.world_size if self.world_size > 1 else loss).backward()
        # Every rank adds the same metric names (weight 0 when empty): they are reduced together.
        m.add_loss_metrics(metrics, n_kept)
        if step.old is None:
            m.add_sum("entropy", ent.sum(), mb.num_labels)
        return loss.detach()

    def _optimizer_step(self, step: _Step, j: int, local_loss: torch.Tensor) -> None:
        """Clip mini-batch ``j``'s gradients and apply them (see below for when not); records the
        loss, gradient norm and learning rate, and clears the gradients."""
        loss_t = local_loss.double()
        if self.world_size > 1:
            dist.all_reduce(loss_t, group=self.group)
        stats = torch.stack([loss_t, self._clip_grad_norm().to(self.device, torch.float64)])  # (loss, grad norm), on the device
        step.lrs.append(self.optimizer.param_groups[0]["lr"])
        if step.num_tokens[j] == 0:
            # Nothing to learn from (all ranks agree): no update; the schedule still advances.
            step.losses.append(0.0)
            step.grad_norms.append(0.0)
        else:
            # A non-finite loss or gradient skips the update. Once AdamW's moments exist the
            # step is queued right behind the backward pass and skipped on the device, and
            # the host reads the loss and norm afterwards; the first step decides on the host.
            found_inf = (~torch.isfinite(stats).all()).float()
            queued = adamw_step_local(self.optimizer, found_inf)
            step_loss, grad_norm = stats.tolist()
            if math.isfinite(step_loss) and math.isfinite(grad_norm):
                if not queued:
                    self.optimizer.step()
                step.losses.append(step_loss)
                step.grad_norms.append(grad_norm)
            else:
                step.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)

    def _scheduler_step(self) -> None:
        with warnings.catch_warnings():
            # A skipped first update would make torch warn that the scheduler stepped first.
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()

    def _step_metrics(self, step: _Step, t0: float) -> dict[str, float]:
        """The step's metrics, reduced over the ranks, with defaults for those no micro-batch gave."""
        # mismatch/* is left out when no sequence carries the engine's logprobs (return_logprob false)
        red = step.metrics.reduce(self.world_size, self.group, absent_when_empty="mismatch/")
        out = finalize_metrics({(name if "/" in name else f"train/{name}"): value for name, value in red.items()})
        out.setdefault("train/entropy", 0.0)
        if "mismatch/logprob_abs_diff" in out:  # its older name (computed once, by the rollout correction)
            out["train/rollout_logprob_diff"] = out["mismatch/logprob_abs_diff"]
        for name in ("clipfrac", "kl_k3"):
            out.setdefault(f"train/{name}", 0.0)
        for name in ("ratio_max", "ratio_min"):
            out.setdefault(f"train/{name}", 1.0)
        losses, grad_norms = step.losses, step.grad_norms
        out.update({
            "train/loss": sum(losses) / len(losses) if losses else float("nan"),
            "train/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "train/lr": step.lrs[-1],
            "train/tokens": float(sum(step.num_tokens)),
            "train/sequences": float(sum(step.num_seqs)),
            "train/skipped_steps": float(step.skipped),
            "train/micro_batches": float(sum(len(b) for b in step.batches)),
            "train/step_time_s": time.perf_counter() - t0,
        })
        return out

    def _accumulating(self, more_to_come: bool) -> None:
        """Gradient accumulation across a mini-batch's micro-batches, on a single rank only.

        Alone, FSDP's per-micro-batch gradient reduce-scatter and parameter re-gather are pure
        copies; skipping them until the last micro-batch costs no memory (sharded == unsharded)
        and saves thousands of small kernels per step. With several ranks the default (sync every
        micro-batch) is kept: accumulating unsharded gradients would cost a full gradient copy.
        """
        if self.world_size == 1:
            self.model.set_requires_gradient_sync(not more_to_come)
            self.model.set_reshard_after_backward(not more_to_come)

    def _clip_grad_norm(self) -> torch.Tensor:
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        group = (self.group or dist.group.WORLD) if self.world_size > 1 else None
        return clip_grad_norm_local(grads, max_norm, group)

    # ----------------------------------------------------------------------- logprobs
    @torch.no_grad()
    def compute_logprobs(self, seqs: list[TrainSequence]) -> list[list[float]]:
        """Logprob (at each sequence's temperature) of every response token, ignoring ``response_mask``.

        Collective: every rank must call it (with its own sequences, possibly none).
        """
        full = [s.with_full_mask() for s in seqs]
        (mbs,) = self._micro_batches(full, [list(range(len(full)))])
        out: list[list[float]] = [[] for _ in seqs]
        self.model.eval()
        try:
            results = [self._forward(mb, with_entropy=False)[0] for mb in mbs]
        finally:
            self.model.reshard()
            self.model.train()
        values = torch.cat(results).float().cpu().tolist() if results else []  # one device-to-host copy
        start = 0
        for mb in mbs:
            for c, i in zip(mb.label_counts, mb.seq_indices):
                out[i] = values[start:start + c]
                start += c
        return out

    # -------------------------------------------------------------------------- weights
    def can_lend_weights(self) -> bool:
        """Whether :meth:`iter_weights` can yield the live parameters themselves (``live=True``):
        one rank, where every parameter's local shard is the whole tensor."""
        return self.world_size == 1

    def iter_weights(
        self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None, live: bool = False,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors in buckets of at most ``bucket_bytes`` (a larger tensor goes alone).

        Collective (every rank gathers every tensor in the same order). Names are exactly those
        of ``AutoModelForCausalLM.state_dict()``, tied ``lm_head.weight`` included (the same
        tensor as the embedding). Tensors are on this rank's device, cast to ``dtype`` (default:
        the run dtype), and never alias the live parameters.

        ``live=True`` (only where :meth:`can_lend_weights`): the parameters' own tensors instead,
        in their training dtype, with no gather, cast or copy; ``dtype`` only sizes the buckets.
        They change with the next optimizer step, so they are for a consumer that copies them at
        once (an ``InferenceBackend`` with ``accepts_live_weights``).
        """
        return weights.iter_weights(self.model, self.hf_model, bucket_bytes, dtype or self.dtype, live,
                                    self.can_lend_weights(), self.adapters)

    def full_state_dict(
        self, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """The whole HF state dict on rank 0 of the group (empty elsewhere). Collective."""
        return weights.full_state_dict(self.iter_weights(dtype=dtype), self.rank == 0, device)

    def save_hf(self, out_dir: str | Path, tokenizer=None, dtype: torch.dtype | None = None) -> Path:
        """Write an HF model dir (safetensors, config, generation config, tokenizer) atomically. Collective."""
        self._check_finite(f"before writing {out_dir}")
        dtype = dtype or self.dtype
        if self.adapters is not None:
            return lora.save_export(self, Path(out_dir), tokenizer, dtype)
        state = self.full_state_dict(dtype=dtype)
        return weights.save_hf(Path(out_dir), self.hf_model, state, dtype, tied=self.tied, tokenizer=tokenizer,
                               writer=self.rank == 0, group=self.group)

    def load_adapter(self, path: str | Path) -> None:
        """LoRA: the adapter of an HF export (``hf/step-N``) into this worker's adapters. Collective."""
        lora.load_export(self, Path(path))

    # ---------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str | Path, extra_state: dict[str, Any] | None = None,
                        *, no_optimizer: bool = False) -> Path:
        """DCP model (+ optimizer) + scheduler + RNG + ``extra_state``, atomically. Collective."""
        self._check_finite(f"before writing {path}")
        self.model.reshard()
        return ckpt.save_checkpoint(path, self.model, self.optimizer, self.scheduler, extra_state,
                                    no_optimizer=no_optimizer, lora=self._lora_meta)

    def load_checkpoint(self, path: str | Path, *, load_optimizer: bool = True,
                        weights_only: bool = False) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote; returns the ``extra_state``. Collective.

        ``weights_only``: restore the model weights alone (no optimizer, LR schedule or RNG), e.g.
        to evaluate a checkpoint. ``load_optimizer=False`` keeps the current optimizer state.
        """
        self.model.reshard()
        if weights_only:
            return ckpt.load_checkpoint(path, self.model, None, None, load_optimizer=False, restore_rng=False,
                                        lora=self._lora_meta)
        return ckpt.load_checkpoint(path, self.model, self.optimizer, self.scheduler, load_optimizer=load_optimizer,
                                    lora=self._lora_meta)

    @property
    def _lora_meta(self) -> dict[str, Any] | None:
        """The adapters' shape that checkpoints record (None: full fine-tuning)."""
        return lora.checkpoint_meta(getattr(self.model_cfg, "lora", None))

    @property
    def vocab_size(self) -> int:
        """Token ids the model has embeddings for."""
        return int(self.hf_model.get_input_embeddings().num_embeddings)

    @property
    def optimizer_steps_done(self) -> int:
        return int(self.scheduler.last_epoch)

    def close(self) -> None:
        """Drop the model and optimizer (the process group stays; see :func:`rlcli.dist.destroy`)."""
        self.optimizer.state.clear()
        del self.optimizer, self.scheduler, self.model, self.hf_model
        self.ref_model = None

