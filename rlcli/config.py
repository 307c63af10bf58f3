"""The recipe: a YAML file validated by the pydantic models below.

Sections: ``model``, ``trainer``, ``resources``, ``rollout``, ``train_worker``, ``advantage``,
``replay_buffer``, ``tasks``, ``eval``. Every *component* section is ``{name: <registered
name>, ...its own config}``; the name is looked up in the plugin registry and the rest is
validated by that component's own ``Config``. :func:`load_recipe` is the single code path used
by ``train``, ``eval`` and ``validate``: it loads, applies overrides, validates and resolves, and
reports *every* problem at once, each with its dotted path. Nothing here loads a model.
"""

from __future__ import annotations

import difflib
import inspect
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from rlcli.overrides import OverrideError, apply_overrides
from rlcli.plugins import PluginError, Registry, get_registry


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Kind:
    """Annotation marking a field as a component section of the given plugin kind."""

    kind: str


class ComponentSpec(BaseModel):
    """``{name: ..., **options}``: a registered component and its options."""

    model_config = ConfigDict(extra="allow")
    name: str
    _cls: type | None = PrivateAttr(None)
    _cfg: BaseModel | None = PrivateAttr(None)

    @property
    def cls(self) -> type:
        if self._cls is None:
            raise RuntimeError(f"component {self.name!r} was not resolved (use rlcli.config.load_recipe)")
        return self._cls

    @property
    def cfg(self) -> Any:
        if self._cfg is None:
            raise RuntimeError(f"component {self.name!r} was not resolved (use rlcli.config.load_recipe)")
        return self._cfg

    def build(self, **runtime: Any) -> Any:
        """Instantiate the component: ``cls(cfg, **runtime)``."""
        return self.cls(self.cfg, **runtime)


def _spec(kind: str, default: dict | None = None, **kw: Any) -> Any:
    if default is None:
        return Annotated[ComponentSpec, Kind(kind)]
    return Annotated[ComponentSpec, Kind(kind), Field(default_factory=lambda: ComponentSpec(**default), **kw)]


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


class ModelConfig(Strict):
    path: str | None = Field(None, description="A local Hugging Face model directory.")
    from_scratch: FromScratch | None = Field(None, description="Random-init architecture instead of `path`.")
    tokenizer: str | None = Field(
        None, description="Tokenizer directory, or 'builtin:<name>'; defaults to `path`."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on GPU, float32 on CPU."
    )


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
        description="Trackers; 'jsonl' (metrics.jsonl) is always added.",
    )
    work_dir: str | None = Field(None, description="Defaults to work_dirs/<recipe file stem>.")
    log_samples_per_step: int = Field(2, ge=0, description="Rollout texts logged to TensorBoard per step.")
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
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")


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
        "(two fused passes over the logits instead of about ten eager ones). Ignored on CPU.")
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
        "correction. The mismatch/* metrics are reported every step either way.")

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


# ------------------------------------------------------------------------------ validation
@dataclass(frozen=True)
class Issue:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<recipe>'}: {self.message}"


class RecipeError(Exception):
    """Raised with every problem of a recipe; ``issues`` lists them with dotted paths."""

    def __init__(self, issues: list[Issue], source: str | None = None):
        self.issues = issues
        self.source = source
        head = f"{source}: " if source else ""
        lines = "\n".join(f"  - {i}" for i in issues)
        super().__init__(f"{head}{len(issues)} problem(s) in recipe:\n{lines}")


def _dotted(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def _unwrap(ann: Any) -> tuple[Any, bool]:
    """Return (inner annotation, is_list) for X, X | None, list[X], Annotated[...]."""
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _unwrap(typing.get_args(ann)[0])
    if origin in (list, tuple) and typing.get_args(ann):
        inner, _ = _unwrap(typing.get_args(ann)[0])
        return inner, True
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return ann, False


def _kind_of(finfo: Any) -> str | None:
    for meta in finfo.metadata:
        if isinstance(meta, Kind):
            return meta.kind
    ann = finfo.annotation
    if typing.get_origin(ann) in (list,):
        (inner,) = typing.get_args(ann)
        if typing.get_origin(inner) is Annotated:
            for meta in typing.get_args(inner)[1:]:
                if isinstance(meta, Kind):
                    return meta.kind
    return None


def _model_class_at(model_cls: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class that owns the last element of ``loc`` (for did-you-mean hints)."""
    cls: Any = model_cls
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return None
        inner, _ = _unwrap(cls.model_fields[part].annotation)
        cls = inner
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _walk_raw(model_cls: type[BaseModel], raw: Any, path: tuple, out: list) -> None:
    """Find component sections in raw (unvalidated) data by following the schema."""
    if not isinstance(raw, dict):
        return
    for fname, finfo in model_cls.model_fields.items():
        if fname not in raw or raw[fname] is None:
            continue
        val = raw[fname]
        kind = _kind_of(finfo)
        inner, is_list = _unwrap(finfo.annotation)
        if kind is not None:
            if is_list:
                for i, v in enumerate(val if isinstance(val, list) else []):
                    out.append((path + (fname, i), kind, v))
            else:
                out.append((path + (fname,), kind, val))
        elif isinstance(inner, type) and issubclass(inner, BaseModel):
            if is_list:
                for i, v in enumerate(val if isinstance(val, list) else []):
                    _walk_raw(inner, v, path + (fname, i), out)
            else:
                _walk_raw(inner, val, path + (fname,), out)


def _collect_specs(obj: Any, path: tuple, out: list) -> None:
    if isinstance(obj, ComponentSpec):
        return
    if isinstance(obj, BaseModel):
        for fname, finfo in type(obj).model_fields.items():
            val = getattr(obj, fname)
            kind = _kind_of(finfo)
            if kind is not None:
                if isinstance(val, list):
                    for i, v in enumerate(val):
                        out.append((_dotted(path + (fname, i)), kind, v))
                elif val is not None:
                    out.append((_dotted(path + (fname,)), kind, val))
            else:
                _collect_specs(val, path + (fname,), out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _collect_specs(v, path + (i,), out)


def _resolve_component(registry: Registry, path: tuple, kind: str, raw: Any, issues: list[Issue]):
    where = _dotted(path)
    if isinstance(raw, ComponentSpec):
        raw = {"name": raw.name, **(raw.model_extra or {})}
    if not isinstance(raw, dict):
        issues.append(Issue(where, f"expected a mapping with a 'name' key naming a {kind}, got {raw!r}"))
        return None
    name = raw.get("name")
    if not isinstance(name, str):
        issues.append(Issue(f"{where}.name", f"required: the name of a registered {kind}; "
                            f"available: {', '.join(registry.names(kind)) or '(none)'}"))
        return None
    try:
        cls = registry.get(kind, name)
    except PluginError as exc:
        issues.append(Issue(f"{where}.name", str(exc)))
        return None
    options = {k: v for k, v in raw.items() if k != "name"}
    try:
        cfg = cls.Config.model_validate(options)
    except ValidationError as exc:
        for err in exc.errors():
            issues.append(_issue_from_pydantic(cls.Config, err, path, extra=f" (options of {kind} {name!r})"))
        return None
    check = getattr(cls, "check_config", None)
    if check is not None:
        takes_registry = "registry" in inspect.signature(check).parameters
        for field_name, msg in (check(cfg, registry=registry) if takes_registry else check(cfg)) or []:
            issues.append(Issue(f"{where}.{field_name}" if field_name else where, msg))
    return cls, cfg


def _issue_from_pydantic(model_cls: type[BaseModel], err: dict, prefix: tuple = (), extra: str = "") -> Issue:
    loc = tuple(err["loc"])
    path = _dotted(prefix + loc)
    if err["type"] == "extra_forbidden":
        owner = _model_class_at(model_cls, loc)
        msg = "unknown key"
        if owner is not None:
            fields = list(owner.model_fields)
            close = difflib.get_close_matches(str(loc[-1]), fields, n=1)
            msg += f" (did you mean {close[0]!r}?)" if close else f"; allowed: {', '.join(fields)}"
        return Issue(path, msg + extra)
    if err["type"] == "missing":
        return Issue(path, "required field is missing" + extra)
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return Issue(path, msg + extra)


def _positive_or_disabled(tr: dict, key: str, issues: list[Issue]) -> int | None:
    v = tr.get(key)
    if v is None or v == -1:
        return None
    if not isinstance(v, int) or v <= 0:
        issues.append(Issue(f"trainer.{key}", f"must be positive or -1/null to disable it, got {v!r}"))
        return None
    return v


def _check_rules(raw: dict, issues: list[Issue]) -> None:
    """The seed's cross-field rules, each message naming both fields."""
    tr = raw.get("trainer") if isinstance(raw.get("trainer"), dict) else {}
    steps, epochs = tr.get("total_train_steps"), tr.get("total_epochs")
    if steps is None and epochs is None:
        issues.append(Issue("trainer.total_train_steps", "either trainer.total_train_steps or trainer.total_epochs must be set"))
    for key, v in (("total_train_steps", steps), ("total_epochs", epochs)):
        if isinstance(v, int) and v <= 0:
            issues.append(Issue(f"trainer.{key}", f"must be positive, got {v}"))
    bs = tr.get("train_batch_size")
    if isinstance(bs, int) and bs <= 0:
        issues.append(Issue("trainer.train_batch_size", f"must be positive, got {bs}"))
    interval = tr.get("sync_weights_interval", 1)
    if isinstance(interval, int) and interval <= 0:
        issues.append(Issue("trainer.sync_weights_interval", f"must be positive, got {interval}"))
        interval = None
    if not isinstance(interval, int):
        interval = None
    for key, why in (("checkpoint_interval", "checkpoints are only saved on weight-sync steps"),
                     ("hf_interval", "HF exports are only saved on weight-sync steps")):
        v = _positive_or_disabled(tr, key, issues)
        if v is not None and interval and v % interval:
            issues.append(Issue(f"trainer.{key}", f"trainer.{key}={v} must be a multiple of "
                                f"trainer.sync_weights_interval={interval}, because {why}"))
    enable_eval = tr.get("enable_evaluate", True)
    if enable_eval is True:
        es = tr.get("evaluate_step", 1)
        if es is None or (isinstance(es, int) and es <= 0):
            issues.append(Issue("trainer.evaluate_step", f"must be positive when trainer.enable_evaluate is true, got {es!r}"))
        elif isinstance(es, int) and interval and es % interval:
            issues.append(Issue("trainer.evaluate_step", f"trainer.evaluate_step={es} must be a multiple of "
                                f"trainer.sync_weights_interval={interval}, because evaluation only runs on weight-sync steps"))
        ev = raw.get("eval")
        if not isinstance(ev, dict) or not ev.get("tasks"):
            issues.append(Issue("eval.tasks", "trainer.enable_evaluate is true but the recipe has no eval.tasks "
                                "(add eval tasks or set trainer.enable_evaluate=false)"))
    _check_disaggregated(raw, issues)
    tasks = raw.get("tasks")
    if isinstance(tasks, list):
        if not tasks:
            issues.append(Issue("tasks", "at least one task is required"))
        _check_tasks(tasks, "tasks", issues)
        weights = [t.get("weight", 1.0) for t in tasks if isinstance(t, dict)]
        if weights and all(isinstance(w, (int, float)) for w in weights) and sum(weights) <= 0:
            issues.append(Issue("tasks", "at least one task weight must be positive (all weights are 0)"))
    ev = raw.get("eval")
    if isinstance(ev, dict) and isinstance(ev.get("tasks"), list):
        _check_tasks(ev["tasks"], "eval.tasks", issues)
        for i, t in enumerate(ev["tasks"]):
            ps = t.get("produce_strategy") if isinstance(t, dict) else None
            if isinstance(ps, dict) and ps.get("name") not in (None, "sync"):
                issues.append(Issue(f"eval.tasks.{i}.produce_strategy.name",
                                    f"evaluation tasks use the 'sync' produce strategy, got {ps.get('name')!r}"))
    m = raw.get("model")
    if isinstance(m, dict):
        if (m.get("path") is None) == (m.get("from_scratch") is None):
            issues.append(Issue("model", "set exactly one of model.path and model.from_scratch"))
        if m.get("from_scratch") is not None and not m.get("tokenizer"):
            issues.append(Issue("model.tokenizer", "required with model.from_scratch (e.g. 'builtin:arith')"))
        if isinstance(m.get("path"), str) and not (Path(m["path"]).expanduser() / "config.json").is_file():
            issues.append(Issue("model.path", f"not a Hugging Face model directory (no config.json): {m['path']}"))
        tok = m.get("tokenizer")
        if isinstance(tok, str) and tok.startswith("builtin:"):
            from rlcli.tokenizer import BUILTIN_TOKENIZERS

            if tok[len("builtin:"):] not in BUILTIN_TOKENIZERS:
                issues.append(Issue("model.tokenizer", f"unknown built-in tokenizer {tok!r}; available: "
                                    + ", ".join(f"builtin:{n}" for n in sorted(BUILTIN_TOKENIZERS))))
        elif isinstance(tok, str) and not Path(tok).expanduser().is_dir():
            issues.append(Issue("model.tokenizer", f"tokenizer directory not found: {tok}"))


def _check_tasks(tasks: list, where: str, issues: list[Issue]) -> None:
    seen: dict[str, int] = {}
    for i, t in enumerate(tasks):
        if not isinstance(t, dict):
            continue
        name = t.get("task_name")
        if isinstance(name, str):
            if name in seen:
                issues.append(Issue(f"{where}.{i}.task_name",
                                    f"duplicate task_name {name!r} (also {where}.{seen[name]}.task_name)"))
            seen[name] = i


# ------------------------------------------------------------------- disaggregated placement
TRAIN_RESOURCES, ROLLOUT_RESOURCES = "resources.train_resources", "resources.rollout_resources"
_BOTH = f"{TRAIN_RESOURCES} and {ROLLOUT_RESOURCES}"


def _placement_side(spec: Any, where: str, issues: list[Issue]) -> tuple[str, Any] | None:
    """``("n", N)`` or ``("ranks", [...])`` for one side's spec; None (and an issue) when unusable."""
    if isinstance(spec, BaseModel):
        spec = spec.model_dump(exclude_none=True)
    if not isinstance(spec, dict):
        issues.append(Issue(where, f"expected {{num_workers: N}} or {{ranks: [...]}}, got {spec!r} ({_BOTH} split "
                            "the launched ranks between training and rollout)"))
        return None
    n, ranks = spec.get("num_workers"), spec.get("ranks")
    if (n is None) == (ranks is None):
        issues.append(Issue(where, f"set exactly one of num_workers and ranks ({_BOTH} each take "
                            "{num_workers: N} or {ranks: [...]})"))
        return None
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            issues.append(Issue(f"{where}.num_workers", f"must be a positive number of ranks, got {n!r}: "
                                f"{_BOTH} each need at least one rank"))
            return None
        return "n", n
    if not isinstance(ranks, list) or not ranks:
        issues.append(Issue(f"{where}.ranks", f"is empty: {_BOTH} each need at least one rank"))
        return None
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad:
        issues.append(Issue(f"{where}.ranks", f"ranks are global rank numbers >= 0, got {bad} ({_BOTH} split the "
                            "launched ranks 0 .. N-1)"))
        return None
    dup = sorted({r for r in ranks if ranks.count(r) > 1})
    if dup:
        issues.append(Issue(f"{where}.ranks", f"lists rank(s) {dup} more than once ({_BOTH} give every launched "
                            "rank exactly one role)"))
        return None
    return "ranks", sorted(ranks)


def resolve_placement(resources: Any, world_size: int | None) -> tuple[list[int], list[int], list[Issue]]:
    """The train ranks and rollout ranks of a disaggregated run, and every problem with them.

    ``resources`` is the ``resources`` section (raw dict or :class:`ResourcesConfig`). A
    ``{num_workers: N}`` side takes the N lowest ranks the other side does not list (both
    ``num_workers``: train ranks first, then rollout ranks). The sides must be non-empty and
    disjoint; when the launch size is known (``world_size``) they must cover exactly ranks
    ``0 .. world_size - 1``. Every message names both fields. On problems the lists are empty.
    """
    if isinstance(resources, BaseModel):
        resources = resources.model_dump()
    resources = resources if isinstance(resources, dict) else {}
    issues: list[Issue] = []
    specs = {}
    for key, where in (("train_resources", TRAIN_RESOURCES), ("rollout_resources", ROLLOUT_RESOURCES)):
        if resources.get(key) is None:
            issues.append(Issue(where, f"required with trainer.mode=disaggregated: {_BOTH} split the launched ranks "
                                "({num_workers: N} or {ranks: [...]} each)"))
            continue
        side = _placement_side(resources[key], where, issues)
        if side is not None:
            specs[key] = side
    if issues or len(specs) != 2:
        return [], [], issues
    (tk, tv), (rk, rv) = specs["train_resources"], specs["rollout_resources"]
    if tk == "ranks" and rk == "ranks":
        train, rollout = tv, rv
        both = sorted(set(train) & set(rollout))
        if both:
            issues.append(Issue(TRAIN_RESOURCES, f"{TRAIN_RESOURCES}.ranks and {ROLLOUT_RESOURCES}.ranks overlap on "
                                f"rank(s) {both}: a rank either trains or rolls out"))
            return [], [], issues
    elif tk == "n" and rk == "n":
        train, rollout = list(range(tv)), list(range(tv, tv + rv))
    elif tk == "ranks":
        train = tv
        rollout = [r for r in range(len(tv) + rv) if r not in set(tv)][:rv]
    else:
        rollout = rv
        train = [r for r in range(len(rv) + tv) if r not in set(rv)][:tv]
    if world_size is not None:
        used = set(train) | set(rollout)
        beyond = sorted(r for r in used if r >= world_size)
        idle = sorted(set(range(world_size)) - used)
        where = ROLLOUT_RESOURCES if beyond and not set(beyond) & set(train) else TRAIN_RESOURCES
        if beyond:
            issues.append(Issue(where, f"{_BOTH} use rank(s) {beyond} but only {world_size} rank(s) are launched "
                                f"(0 .. {world_size - 1}; --nproc-per-node x --nnodes): train ranks {train}, rollout "
                                f"ranks {rollout}"))
        elif idle:
            issues.append(Issue(where, f"{_BOTH} cover {len(used)} rank(s) but {world_size} are launched "
                                f"(--nproc-per-node x --nnodes); rank(s) {idle} would have no role: train ranks "
                                f"{train}, rollout ranks {rollout}"))
        if issues:
            return [], [], issues
    return train, rollout, issues


def _check_disaggregated(raw: dict, issues: list[Issue]) -> None:
    tr = raw.get("trainer") if isinstance(raw.get("trainer"), dict) else {}
    res = raw.get("resources") if isinstance(raw.get("resources"), dict) else {}
    if tr.get("mode", "colocate") != "disaggregated":
        for key, where in (("train_resources", TRAIN_RESOURCES), ("rollout_resources", ROLLOUT_RESOURCES)):
            if res.get(key) is not None:
                issues.append(Issue(where, f"only used with trainer.mode=disaggregated (trainer.mode is "
                                    f"{tr.get('mode', 'colocate')!r}); {_BOTH} split the launched ranks"))
        return
    issues.extend(resolve_placement(res, None)[2])
    tasks = raw.get("tasks")
    for i, t in enumerate(tasks if isinstance(tasks, list) else []):
        ps = t.get("produce_strategy") if isinstance(t, dict) else None
        name = ps.get("name") if isinstance(ps, dict) else "sync"
        if name != "async":
            issues.append(Issue(f"tasks.{i}.produce_strategy.name",
                                f"trainer.mode=disaggregated trains from a background producer: training tasks use "
                                f"the 'async' produce strategy (over_sample_threshold: 0, max_staleness: 0 for "
                                f"on-policy lock-step), got {name!r}"))


def check_launch(recipe: Recipe, world_size: int) -> list[Issue]:
    """Problems of ``recipe`` launched on ``world_size`` ranks (disaggregated placements)."""
    if recipe.trainer.mode != "disaggregated":
        return []
    train, rollout, issues = resolve_placement(recipe.resources, world_size)
    if not issues and recipe.trainer.train_batch_size < len(rollout):
        issues.append(Issue("trainer.train_batch_size", f"trainer.train_batch_size={recipe.trainer.train_batch_size} "
                            f"is smaller than the {len(rollout)} ranks of {ROLLOUT_RESOURCES}: every rollout rank "
                            "produces at least one group per step"))
    return issues


def validate_recipe(raw: Any, registry: Registry | None = None, source: str | None = None,
                    base_dir: str | Path | None = None) -> Recipe:
    """Validate and resolve raw recipe data; raise :class:`RecipeError` listing every problem.

    ``base_dir`` (default: the folder of ``source``) is where relative data paths also resolve.
    """
    from rlcli.data.sampler import RECIPE_DIR

    registry = registry or get_registry()
    if base_dir is None and source is not None:
        base_dir = Path(source).resolve().parent
    if base_dir is not None:
        RECIPE_DIR.set(Path(base_dir))
    if not isinstance(raw, dict):
        raise RecipeError([Issue("", f"a recipe must be a YAML mapping, got {type(raw).__name__}")], source)
    issues: list[Issue] = []
    recipe: Recipe | None = None
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as exc:
        for err in exc.errors():
            issues.append(_issue_from_pydantic(Recipe, err))
    _check_rules(raw, issues)

    found: list = []
    if recipe is not None:
        for path, kind, spec in recipe.components():
            found.append((tuple(int(p) if p.isdigit() else p for p in path.split(".")), kind, spec))
    else:
        _walk_raw(Recipe, raw, (), found)
    for path, kind, spec in found:
        resolved = _resolve_component(registry, path, kind, spec, issues)
        if resolved is not None and isinstance(spec, ComponentSpec):
            spec._cls, spec._cfg = resolved

    if recipe is not None:
        for check in _recipe_checks(registry):
            for path, msg in check(recipe) or []:
                issues.append(Issue(path, msg))
    # de-duplicate while keeping order
    uniq = list(dict.fromkeys(issues))
    if uniq:
        raise RecipeError(uniq, source)
    assert recipe is not None
    recipe._registry = registry
    if source is not None:
        recipe._source = Path(source)
    return recipe


def _recipe_checks(registry: Registry) -> list:
    """Whole-recipe checks a component class declares with ``check_recipe(recipe) -> [(path, msg)]``."""
    checks = []
    seen = set()
    for table in registry.entries.values():
        for entry in table.values():
            fn = getattr(entry.cls, "check_recipe", None)
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                checks.append(fn)
    return checks


def read_yaml(path: str | Path) -> Any:
    p = Path(path)
    if not p.exists():
        raise RecipeError([Issue("", f"recipe file not found: {p}")], str(p))
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise RecipeError([Issue("", f"invalid YAML: {where}{getattr(exc, 'problem', exc)}")], str(p)) from None


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (), registry: Registry | None = None) -> Recipe:
    """Load a recipe file, apply ``key=value`` / ``~key`` overrides, validate and resolve it."""
    raw = read_yaml(path)
    try:
        raw = apply_overrides(raw, list(overrides))
    except OverrideError as exc:
        raise RecipeError([Issue(exc.path, exc.message)], str(path)) from None
    recipe = validate_recipe(raw, registry, source=str(path))
    recipe._source = Path(path)
    return recipe


def resolved_dict(recipe: Recipe) -> dict:
    """The recipe with every default and every component option filled in (for resolved.yaml)."""
    data = recipe.model_dump(mode="json")
    for path, _kind, spec in recipe.components():
        cur: Any = data
        parts = [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parts[:-1]:
            cur = cur[p]
        cur[parts[-1]] = {"name": spec.name, **spec.cfg.model_dump(mode="json")}
    return data
