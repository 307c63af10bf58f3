"""The shape every registered component shares, and the optional capabilities it may add.

A component has a ``name`` and a pydantic ``Config`` (:class:`Component`). Beyond what its
kind's base class requires, a component may offer an *optional capability*: a method or a class
attribute that rlcli calls or reads when it is there. Each one is a :class:`typing.Protocol`
below, and the code that uses it asks ``isinstance(x, TheProtocol)``, never ``hasattr``. The
protocols are runtime-checkable, so a plugin's class has a capability when it defines the member,
whether or not it derives from anything here. ``docs/plugins.md`` ("Optional capabilities")
lists them with the kinds they apply to; :data:`CAPABILITIES` is that list.

A flag (:class:`AcceptsLiveWeights`, :class:`RatioOnly`) has a default of False on its kind's
base class, so its protocol says that the class *declares* the flag; the caller also reads its
value. Optional methods with a default on a base class (a backend's ``sleep``/``wake_up``, a
produce strategy's ``drain``, a tracker's ``truncate_after``, a tool's ``close``, ...) are part
of that base class's contract and are called without asking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from rlcli.types import Sample


class ComponentConfig(BaseModel):
    """Base for component configs: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Component:
    """Base for registered components. Subclasses set ``name`` and usually override ``Config``."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[ComponentConfig]] = ComponentConfig

    def __init__(self, config: ComponentConfig | None = None):
        self.config = config if config is not None else self.Config()


# ------------------------------------------------------------------------ optional capabilities
# Class-level checks (ChecksConfig, ChecksRecipe) are asked of the component class, the others of
# the built instance.


@runtime_checkable
class ChecksConfig(Protocol):
    """Any kind: extra validation of the component's own options, past what ``Config`` checks.

    ``check_config(cfg) -> [(field, message)]``, a classmethod; it may also take a keyword
    ``registry`` (the component registry, for options that name other components). Called while
    a recipe is loaded (``rlcli validate``, ``rlcli train``) on each component section, and on each
    judger section inside a judger's options (``composed`` branches, the judger ``overlong``
    wraps); each pair becomes an error at ``<section>.<field>``."""

    @classmethod
    def check_config(cls, cfg: Any) -> list[tuple[str, str]]: ...


@runtime_checkable
class ChecksRecipe(Protocol):
    """Any kind: rules that span the whole recipe (e.g. an engine backend that needs CUDA).

    ``check_recipe(recipe) -> [(dotted_path, message)]``, a classmethod. Called while a recipe is
    loaded, for every registered class whether the recipe uses it or not, so it returns nothing
    for a recipe that does not select it."""

    @classmethod
    def check_recipe(cls, recipe: Any) -> list[tuple[str, str]]: ...


@runtime_checkable
class Shardable(Protocol):
    """Sampler: hand out only this process's share of the prompts.

    ``shard(index, count)``, called once by the runner after the sampler is built and before it
    samples, so that each of ``count`` rollout processes gets distinct prompts. A sampler without
    it gives every process the same stream."""

    def shard(self, index: int, count: int) -> None: ...


@runtime_checkable
class ComputesGroups(Protocol):
    """Advantage estimator: the advantages of many groups in one call.

    ``compute_groups(rewards, lengths) -> advantages`` (lists of lists, one per group), called
    once per training step by the runner. ``AdvantageEstimator`` implements it with a loop over
    ``compute``; for an estimator with ``compute`` only, the runner runs that same loop."""

    def compute_groups(self, rewards: list[list[float]], lengths: list[list[int]]) -> list[list[float]]: ...


@runtime_checkable
class ReportsRolloutMetrics(Protocol):
    """Agent loop: scalars of its own about a step's rollouts (``multi_turn``: ``tool/*``).

    ``rollout_metrics(samples) -> {name: value}``, called by the rollout manager once per step
    with that task's samples; logged under the names given (``task/<task>/...`` with several
    tasks)."""

    def rollout_metrics(self, samples: Iterable[Sample]) -> dict[str, float]: ...


@runtime_checkable
class HasJudgePool(Protocol):
    """Agent loop: exposes the judge pool it judges with (``AgentLoop`` keeps it as ``judge_pool``).

    Read by a produce strategy's ``drain`` after a pause, to give that pool's judge calls in
    flight their grace period (see :class:`CancelsJudging`). None: no judge calls to wait for."""

    judge_pool: Any


@runtime_checkable
class CancelsJudging(Protocol):
    """Judge pool: can cancel its calls in flight after a grace period (``JudgePool`` can).

    ``pending`` (calls in flight) and ``await cancel_pending(grace_s)``, used by a produce
    strategy's ``drain``: while rollout groups are still running after a pause and calls are
    pending, they get what is left of ``judge_grace_s``, then are cancelled (their samples become
    ABORTED and are judged again when the group is continued)."""

    pending: int

    async def cancel_pending(self, grace_s: float) -> int: ...


@runtime_checkable
class AcceptsLiveWeights(Protocol):
    """Inference backend flag (default False on ``InferenceBackend``): ``update_weights`` has
    copied and cast every tensor when it returns.

    Read by the colocated runner before each weight sync: when True (and the trainer holds its
    parameters whole) the backend is handed the trainer's own parameters, in their training
    dtype, instead of cast copies."""

    accepts_live_weights: ClassVar[bool]


@runtime_checkable
class RatioOnly(Protocol):
    """Policy loss flag (default False on ``PolicyLoss``): the loss and its metrics depend on
    ``logp`` and ``old_logp`` only through ``logp - old_logp``.

    Read by the trainer when it plans a step: with one optimizer step per batch (and no KL,
    entropy or rollout-IS term reading the logprobs) it then computes the LM head's gradient in
    the forward pass (``train_worker.head_grad_in_forward``)."""

    ratio_only: ClassVar[bool]


#: Every optional capability, in the order ``docs/plugins.md`` lists them.
CAPABILITIES: tuple[type, ...] = (
    ChecksConfig, ChecksRecipe, Shardable, ComputesGroups, ReportsRolloutMetrics, HasJudgePool, CancelsJudging,
    AcceptsLiveWeights, RatioOnly,
)
