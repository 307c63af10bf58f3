"""The recipe's sections as pydantic models, down to :class:`Recipe`, the whole file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from rlcli.config.spec import ComponentSpec, Kind, Strict, _spec
from rlcli.config.tree import _collect_specs


# ----------------------------------------------------------------------------------- model
class FromScratch(Strict):
    """A randomly initialised decoder for toy and test runs (no download)."""

    arch: Literal["qwen2", "llama", "qwen3"] = Field("qwen2", description="Hugging Face model type to instantiate.")
    hidden_size: int = Field(64, gt=0, description="Model width.")
    num_hidden_layers: int = Field(2, gt=0, description="Decoder layers.")
    num_attention_heads: int = Field(4, gt=0, description="Query heads.")
    num_key_value_heads: int = Field(2, gt=0, description="Key/value heads (GQA).")
    intermediate_size: int = Field(128, gt=0, description="MLP width.")
    max_position_embeddings: int = Field(512, gt=0, description="Longest prompt + response.")
    rope_theta: float = Field(10000.0, description="RoPE base.")
    tie_word_embeddings: bool = Field(True, description="Share input and output embeddings.")


class LoraConfig(Strict):
    """Low-rank adapters (LoRA, with ``peft``: ``pip install 'rlcli[lora]'``); only the adapters train."""

    r: int = Field(8, gt=0, description="Rank of each adapter (A: r x in, B: out x r).")
    alpha: float = Field(16.0, gt=0, description="Scale: the layer computes W x + (alpha / r) B A x.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input, in training forwards.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Linear layers of the decoder layers that get an adapter, by name (such as "
        "[q_proj, v_proj]), or all-linear: every one of them. The embeddings and the LM head never do.")
    export_merged: bool = Field(
        False, description="HF exports (hf/step-N) also hold the merged model in hf/step-N/merged, besides "
        "the adapter.")

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, targets: list[str] | str) -> list[str] | str:
        if isinstance(targets, list):
            if not targets:
                raise ValueError("an empty list adapts nothing: name linear layers (such as [q_proj, v_proj]) "
                                 "or use all-linear")
            bad = [t for t in targets if t in ("lm_head", "embed_tokens")]
            if bad:
                raise ValueError(f"{', '.join(bad)}: only linear layers inside the decoder layers can take an "
                                 "adapter (the embeddings and the LM head stay frozen)")
        return targets

    @model_validator(mode="after")
    def _check_peft(self):
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise ValueError("LoRA needs the peft package: pip install 'rlcli[lora]'")
        return self


class ModelConfig(Strict):
    path: str | None = Field(None, description="A Hugging Face model: a local directory, or a Hub id (org/name) "
                             "downloaded to the Hugging Face cache (read from it with HF_HUB_OFFLINE=1).")
    from_scratch: FromScratch | None = Field(None, description="Random-init architecture instead of `path`.")
    tokenizer: str | None = Field(
        None, description="Tokenizer directory or Hub id (org/name), or 'builtin:<name>'; defaults to `path`."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on GPU, float32 on CPU."
    )
    lora: LoraConfig | None = Field(
        None, description="Train low-rank adapters instead of every weight: {r, alpha, dropout, target_modules, "
        "export_merged}; null (the default): full fine-tuning.")


# --------------------------------------------------------------------------------- trainer
class TrainerConfig(Strict):
    mode: Literal["colocate", "disaggregated"] = Field(
        "colocate", description="colocate: rollout and training take turns on the same devices. disaggregated: "
        "resources.rollout_resources ranks produce in the background while resources.train_resources ranks train "
        "(docs/disaggregated.md).")
    total_train_steps: int | None = Field(None, description="Training steps; wins over total_epochs.")
    total_epochs: int | None = Field(None, description="Passes over the train prompts (steps = prompts // batch × epochs).")
    train_batch_size: int = Field(..., description="Prompt groups consumed per training step.")
    sync_weights_interval: int = Field(1, description="Push weights to the inference backend every N steps.")
    seed: int = Field(42, description="Seeds model init, sampling and shuffling.")
    enable_evaluate: bool = Field(True, description="Run eval.tasks every evaluate_step steps and at the end.")
    enable_initial_evaluate: bool = Field(False, description="Also evaluate before training (step 0).")
    evaluate_step: int | None = Field(1, description="Evaluation interval (a multiple of sync_weights_interval).")
    checkpoint_interval: int | None = Field(-1, description="Checkpoint every N steps; -1/null: never.")
    checkpoint_maxkeep: int | None = Field(-1, description="Keep only the newest N checkpoints; -1: all.")
    checkpoint_no_save_optimizer: bool = Field(False, description="Smaller checkpoints without optimizer state (resume then restarts Adam moments).")
    hf_interval: int | None = Field(-1, description="Export a Hugging Face model every N steps (and always at the last step).")
    hf_maxkeep: int | None = Field(-1, description="Keep only the newest N HF exports; -1: all.")
    auto_resume: bool = Field(False, description="Continue from the newest complete checkpoint in the work dir.")
    exp_tracker: list[Annotated[ComponentSpec, Kind("tracker")]] = Field(
        default_factory=lambda: [ComponentSpec(name="tensorboard"), ComponentSpec(name="jsonl")],
        description="Trackers (jsonl, tensorboard, wandb, mlflow); 'jsonl' (metrics.jsonl) is always added.",
    )
    work_dir: str | None = Field(None, description="Defaults to work_dirs/<recipe file stem>.")
    log_samples_per_step: int = Field(2, ge=0, description="Rollouts logged to the trackers per step (TensorBoard texts, "
                                      "the wandb table, the mlflow samples/ artifacts).")
    dump_rollout_groups: int = Field(
        4, ge=0, description="Groups per step written to rollouts/step-N.jsonl (the best and worst by reward).")
    log_every: int = Field(1, gt=0, description="Console summary every N steps.")
    update_weight_bucket_mb: int = Field(
        512, gt=0, description="trainer.mode disaggregated: weights go from train rank 0 to the rollout ranks in "
        "buckets of at most this many MiB (a larger tensor goes alone).")
    peer_timeout_s: float = Field(
        1800.0, gt=0, description="trainer.mode disaggregated: a rank waiting longer than this for its peers (a "
        "rollout batch, the next command, a weight update) fails the run instead of hanging.")


class PlacementConfig(Strict):
    """Ranks of one launch given to one side of a disaggregated run: ``{num_workers: N}`` or ``{ranks: [...]}``."""

    num_workers: int | None = Field(
        None, description="This many ranks, assigned in order: train ranks first, then rollout ranks.")
    ranks: list[int] | None = Field(None, description="These global ranks (0 .. launched ranks - 1).")


class ResourcesConfig(Strict):
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available.")
    num_threads: int | None = Field(None, gt=0, description="torch intra-op threads on CPU.")
    expandable_segments: bool | None = Field(
        None, description="CUDA caching allocator's expandable segments for the run (docs/recipes.md#memory). "
        "Unset: on when the inference backend allows them (the embedded engine) and neither PYTORCH_ALLOC_CONF nor PYTORCH_CUDA_ALLOC_CONF is "
        "set; otherwise as the environment has it. Long-tailed responses make packs of every length: without "
        "them the benchmark's 7B long-tail step ran out of memory with 31.7 GiB reserved but unused. vLLM's "
        "sleep mode refuses them.")
    train_resources: PlacementConfig | None = Field(
        None, description="trainer.mode disaggregated: the ranks that train (FSDP2 over their own process group), "
        "`{num_workers: N}` or `{ranks: [...]}`. Disjoint from rollout_resources; together they cover every "
        "launched rank.")
    rollout_resources: PlacementConfig | None = Field(
        None, description="trainer.mode disaggregated: the ranks that each host an inference replica and produce "
        "rollouts in the background, `{num_workers: N}` or `{ranks: [...]}`.")


# ---------------------------------------------------------------------------- train worker
class OptimizerConfig(Strict):
    name: Literal["adamw"] = Field("adamw", description="Optimizer.")
    lr: float = Field(1e-6, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    moment_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype AdamW stores its two moment estimates in. bfloat16 halves the optimizer's "
        "memory (12 bytes a trained parameter with weights and gradients, instead of 16: 91 GB instead of 122 GB "
        "for a 7B model: the benchmark's 7B step trained so on one H200, nothing offloaded); the update is still "
        "computed in float32 and applied to float32 master weights. "
        "float32 uses torch's fused AdamW.")

    @field_validator("betas")
    @classmethod
    def _check_betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        bad = [f"betas[{i}]={b}" for i, b in enumerate(betas) if not 0 <= b < 1]
        if bad:
            raise ValueError(f"{', '.join(bad)} outside [0, 1): Adam's betas are decay rates of its moment "
                             "averages (the usual values are 0.9 and 0.999)")
        return betas


class LRSchedulerConfig(Strict):
    name: Literal["constant", "linear", "cosine"] = Field("constant", description="Decay after warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up, in optimizer steps.")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Warm-up as a fraction of all optimizer steps (if warmup_steps is 0).")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR as a fraction of the peak (linear, cosine).")


class FSDPConfig(Strict):
    reshard_after_forward: bool = Field(True, description="Free gathered parameters after each layer's forward.")
    cpu_offload: bool = Field(False, description="Keep sharded parameters and optimizer state in CPU memory.")
    param_dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="Compute dtype (auto: model.dtype).")
    reduce_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Gradient reduction dtype.")
    torch_compile: bool = Field(False, description="torch.compile each decoder layer.")
    activation_memory_budget: float = Field(
        1.0, ge=0, le=1, description="With torch_compile: the share of each decoder layer's activations kept "
        "for the backward pass; the compiler recomputes the rest, cheapest first. 1 keeps them all; 0 keeps "
        "only each layer's inputs (like full activation checkpointing, one more forward's compute).")

    @model_validator(mode="after")
    def _check_budget(self):
        if self.activation_memory_budget < 1 and not self.torch_compile:
            raise ValueError(f"activation_memory_budget={self.activation_memory_budget} needs torch_compile: true "
                             "(the compiler does the recomputation); for eager layers use "
                             "train_worker.gradient_checkpointing")
        return self


class KLConfig(Strict):
    """KL penalty to a frozen reference model (the initial policy)."""

    coef: float = Field(0.0, ge=0, description="Weight of the per-token KL term in the loss; 0 disables it and "
                        "no reference model is loaded.")
    type: Literal["k1", "k2", "k3", "low_var_kl", "abs"] = Field(
        "low_var_kl", description="Estimator of KL(policy || reference) per sampled token: k1 = logp - ref, "
        "k2 = (logp - ref)^2 / 2, abs = |logp - ref|, k3 = low_var_kl = exp(ref - logp) - (ref - logp) - 1 "
        "(difference clamped to +-20, value to +-10).")
    ref_offload: bool = Field(False, description="Keep the reference model's shards in CPU memory and move them "
                              "to the GPU layer by layer when its logprobs are computed (no effect on CPU).")


class RolloutISConfig(Strict):
    """Rollout/training mismatch correction: truncated (TIS) or masked (MIS) importance sampling."""

    level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="IS weight from old - rollout logprobs: per token, exp of the sequence sum, or exp "
        "of the sequence mean (every token of a sequence then shares one weight).")
    mode: Literal["truncate", "mask", "both"] = Field(
        "truncate", description="truncate: clamp weights to [threshold_lower, threshold_upper]; mask: drop tokens "
        "whose weight is outside [mask_lower, mask_upper] and weight the rest; both: mask, then truncate.")
    threshold_upper: float | None = Field(None, gt=0, description="Truncation: weights above are clamped to it; "
                                          "null (with threshold_lower null): no truncation.")
    threshold_lower: float | None = Field(None, ge=0, description="Truncation: weights below are raised to it; "
                                          "null: no lower clamp.")
    mask_upper: float | None = Field(None, gt=0, description="Masking: tokens with a larger weight are dropped "
                                     "(default: threshold_upper).")
    mask_lower: float | None = Field(None, ge=0, description="Masking: tokens with a smaller weight are dropped "
                                     "(default: threshold_lower).")
    veto_upper: float | None = Field(None, gt=0, description="A sequence with any token ratio above it is dropped "
                                     "whole (any mode); null: no upper veto.")
    veto_lower: float | None = Field(None, ge=0, description="A sequence with any token ratio below it is dropped "
                                     "whole (any mode); null or 0: no lower veto.")

    @model_validator(mode="after")
    def _check_bands(self):
        for band, (lo, hi) in self.bands().items():
            if lo is not None and hi is not None and not hi > lo:
                names = {"threshold": ("threshold_lower", "threshold_upper"),
                         "mask": ("mask_lower" if self.mask_lower is not None else "threshold_lower",
                                  "mask_upper" if self.mask_upper is not None else "threshold_upper"),
                         "veto": ("veto_lower", "veto_upper")}[band]
                raise ValueError(f"{names[1]}={hi} must be greater than {names[0]}={lo} (the {band} band "
                                 f"keeps weights in [{names[0]}, {names[1]}])")
        return self

    def bands(self) -> dict[str, tuple[float | None, float | None]]:
        """``(lower, upper)`` of the threshold, mask and veto bands (mask bounds default to the threshold's)."""
        return {
            "threshold": (self.threshold_lower, self.threshold_upper),
            "mask": (self.mask_lower if self.mask_lower is not None else self.threshold_lower,
                     self.mask_upper if self.mask_upper is not None else self.threshold_upper),
            "veto": (self.veto_lower, self.veto_upper),
        }


class TrainWorkerConfig(Strict):
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = Field(default_factory=LRSchedulerConfig)
    loss: _spec("policy_loss", {"name": "vanilla"})  # type: ignore[valid-type]
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    optimizer_steps: int = Field(1, gt=0, description="Optimizer steps per rollout batch.")
    pack_max_length: int = Field(8192, gt=0, description="Max tokens per packed micro-batch.")
    max_grad_norm: float | None = Field(1.0, description="None disables clipping.")
    gradient_checkpointing: bool = False
    logprob_chunk_size: int = Field(1024, gt=0, description="Tokens per chunk for logprob/entropy.")
    fused_logprob: bool = Field(
        True, description="On CUDA, torch.compile the per-chunk softmax math of logprob/entropy and its gradient "
        "(two fused passes over the logits instead of about ten eager ones; its compilation costs some seconds "
        "of start-up, see rollout.compile). Ignored on CPU.")
    head_grad_in_forward: bool = Field(
        True, description="When every token's loss gradient is known before the forward pass (one optimizer "
        "step per batch, a ratio-only policy loss, no KL penalty or entropy bonus, no rollout IS weighting or masking), compute "
        "the LM head's gradient in the forward pass while each chunk's logits exist, instead of projecting "
        "every chunk again in the backward pass. Same gradients; otherwise ignored.")
    pack_layout: Literal["auto", "packed", "padded"] = Field(
        "auto",
        description="How a pack is run: one row with restarting position ids (packed), one right-padded row "
        "per sequence (padded), or whichever costs less for the model's attention (auto).",
    )
    share_prompts: bool = Field(
        False, description="Run each prompt once for all of its responses in a pack (the shared layout): every "
        "per-token layer skips the repeated prompt tokens, attention still sees each response with its own "
        "prompt. Same results up to floating-point order; pack_max_length then counts each prompt once. "
        "Requires pack_layout auto.")
    entropy_coef: float = Field(
        0.0, ge=0, description="Entropy bonus: minus this times the policy's entropy at each trained token, "
        "aggregated like the policy loss (loss.loss_agg), is added to the loss; it keeps sampling exploratory "
        "(verl's entropy_coeff). 0 disables it.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty to the frozen initial policy: "
                         "{coef, type, ref_offload}; coef 0 (the default) disables it.")
    rollout_is: RolloutISConfig | None = Field(
        None, description="Correct the rollout/training logprob mismatch with importance sampling; null: no "
        "correction. The mismatch/* metrics are reported every step either way (unless the tasks' "
        "sample_params.return_logprob is false: then there is nothing to compare).")

    @model_validator(mode="after")
    def _check_share_prompts(self):
        if self.share_prompts and self.pack_layout != "auto":
            raise ValueError(f"share_prompts runs every pack in its own layout; pack_layout={self.pack_layout!r} "
                             "cannot apply (set it to auto, or share_prompts to false)")
        return self


# ----------------------------------------------------------------------------------- tasks
class TaskConfig(Strict):
    task_name: str = Field(..., description="Unique name; metrics are reported per task.")
    weight: float = Field(1.0, ge=0, description="Share of train_batch_size (largest-remainder split).")
    sampler: _spec("sampler")  # type: ignore[valid-type]
    agent_loop: _spec("agent_loop", {"name": "single_turn"})  # type: ignore[valid-type]
    judger: _spec("judger")  # type: ignore[valid-type]
    produce_strategy: _spec("produce_strategy", {"name": "sync"})  # type: ignore[valid-type]
    group_filters: list[Annotated[ComponentSpec, Kind("group_filter")]] = Field(default_factory=list)


class EvaluatorConfig(Strict):
    sample_num: int = Field(0, ge=0, description="Prompts per evaluation; 0 = use sample_ratio or all.")
    sample_ratio: float = Field(0.0, ge=0, le=1)
    metrics: list[Annotated[ComponentSpec, Kind("evaluator_metric")]] = Field(
        default_factory=lambda: [ComponentSpec(name="accuracy")]
    )


class EvalConfig(Strict):
    tasks: list[TaskConfig] = Field(default_factory=list)
    evaluator: EvaluatorConfig = Field(default_factory=EvaluatorConfig)


class Recipe(Strict):
    description: str = ""
    model: ModelConfig
    trainer: TrainerConfig
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    rollout: _spec("inference_backend", {"name": "embedded"})  # type: ignore[valid-type]
    train_worker: TrainWorkerConfig = Field(default_factory=TrainWorkerConfig)
    advantage: _spec("advantage_estimator", {"name": "grpo"})  # type: ignore[valid-type]
    replay_buffer: _spec("replay_buffer", {"name": "sync"})  # type: ignore[valid-type]
    tasks: list[TaskConfig]
    eval: EvalConfig | None = None

    # set by load_recipe / validate_recipe
    _source: Path | None = PrivateAttr(None)
    _registry: Any = PrivateAttr(None)

    def components(self) -> list[tuple[str, str, ComponentSpec]]:
        """Every component section as (dotted path, kind, spec)."""
        out: list[tuple[str, str, ComponentSpec]] = []
        _collect_specs(self, (), out)
        return out
