"""Optional capabilities: the Protocols of ``rlcli.component`` detect what the old attribute probes
detected, on the built-in components and on duck-typed third-party classes; rlcli asks for a
capability only through them; ``docs/plugins.md`` lists each one."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Protocol

import pytest

from rlcli import component
from rlcli.component import (
    CAPABILITIES,
    AcceptsLiveWeights,
    CancelsJudging,
    ChecksConfig,
    ChecksRecipe,
    ComputesGroups,
    HasJudgePool,
    RatioOnly,
    ReportsRolloutMetrics,
    Shardable,
)
from rlcli.plugins import registry_with

REPO = Path(__file__).resolve().parents[1]

# What rlcli used to probe, by name, before the Protocols: the member each one stands for.
OLD_PROBES = {
    ChecksConfig: "check_config",
    ChecksRecipe: "check_recipe",
    Shardable: "shard",
    ComputesGroups: "compute_groups",
    ReportsRolloutMetrics: "rollout_metrics",
    HasJudgePool: "judge_pool",
    CancelsJudging: "pending",
    AcceptsLiveWeights: "accepts_live_weights",
    RatioOnly: "ratio_only",
}
FLAGS = {AcceptsLiveWeights, RatioOnly}  # read as getattr(x, name, False): declared *and* true
DATA = {HasJudgePool, CancelsJudging}  # read as getattr(x, name, None/0), then the value is used

# The built-in (rlcli's own) components that have each class-level capability; flags: set to True.
EXPECTED = {
    ChecksConfig: {("agent_loop", "multi_turn"), ("judger", "composed"), ("judger", "overlong"),
                   *(("sampler", n) for n in ("jsonl", "parquet", "hf_dataset")),
                   ("tracker", "wandb"), ("tracker", "mlflow")},
    ChecksRecipe: {("judger", "overlong")},
    Shardable: {("sampler", n) for n in ("jsonl", "parquet", "hf_dataset")},
    ComputesGroups: {("advantage_estimator", n) for n in ("grpo", "dr_grpo", "xtuner_dr_grpo", "rloo", "pass_at_k")},
    ReportsRolloutMetrics: {("agent_loop", "multi_turn")},
    AcceptsLiveWeights: {("inference_backend", "embedded")},
    RatioOnly: {("policy_loss", "vanilla"), ("policy_loss", "gspo")},
}


def members(proto: type) -> set[str]:
    """The names a Protocol declares (methods and annotated attributes)."""
    return {n for n in (*vars(proto), *getattr(proto, "__annotations__", {})) if not n.startswith("_")}


def _old(obj, proto) -> bool:
    name = OLD_PROBES[proto]
    if proto in FLAGS:
        return bool(getattr(obj, name, False))
    if proto in DATA:
        return hasattr(obj, name)
    return getattr(obj, name, None) is not None


def _new(obj, proto) -> bool:
    if proto in FLAGS:
        return isinstance(obj, proto) and bool(getattr(obj, OLD_PROBES[proto]))
    return isinstance(obj, proto)


@pytest.fixture(scope="module")
def builtin_classes():
    with pytest.MonkeyPatch.context() as mp:  # rlcli's own components only
        mp.setenv("RLCLI_DISABLE_PLUGIN_AUTOLOAD", "1")
        reg = registry_with()
    return [(kind, name, e.cls) for kind, table in reg.entries.items() for name, e in table.items()]


def test_every_capability_is_listed_and_has_its_old_name():
    assert set(CAPABILITIES) == set(OLD_PROBES)
    assert len(CAPABILITIES) == len(set(CAPABILITIES))
    protos = {v for v in vars(component).values()
              if isinstance(v, type) and v is not Protocol and getattr(v, "_is_protocol", False)}
    assert protos == set(CAPABILITIES), "a Protocol in rlcli.component is missing from CAPABILITIES"
    for proto, name in OLD_PROBES.items():
        assert name in members(proto), f"{proto.__name__} does not declare {name!r}"
        assert proto.__doc__ and len(proto.__doc__.split()) > 15, f"{proto.__name__} needs a docstring"


@pytest.mark.parametrize("proto", sorted(EXPECTED, key=lambda p: p.__name__), ids=lambda p: p.__name__)
def test_builtin_components_have_the_capabilities_they_had(builtin_classes, proto):
    have = {(kind, name) for kind, name, cls in builtin_classes if _new(cls, proto)}
    assert have == EXPECTED[proto]
    for kind, name, cls in builtin_classes:  # the Protocol agrees with the name probe it replaced
        assert _new(cls, proto) == _old(cls, proto), (proto.__name__, kind, name)


def test_instance_level_capabilities_of_the_builtins():
    from rlcli.agent_loops import SingleTurnAgentLoop
    from rlcli.judgers.exact_match import ExactMatchJudger
    from rlcli.judgers.pool import JudgePool

    pool = JudgePool(ExactMatchJudger(), executor="inline")
    try:
        loop = SingleTurnAgentLoop(SingleTurnAgentLoop.Config(), backend=None, judge_pool=pool, tokenizer=None,
                                   eos_token_ids=[0], seed=0)
        assert isinstance(loop, HasJudgePool) and loop.judge_pool is pool
        assert isinstance(pool, CancelsJudging) and pool.pending == 0
        assert not isinstance(ExactMatchJudger(), (CancelsJudging, HasJudgePool, Shardable))
    finally:
        pool.close()


def test_duck_typed_third_party_classes_are_detected():
    """A plugin's class that defines the member, deriving from nothing of rlcli's, has the capability."""

    class Sampler:
        def shard(self, index, count):
            pass

    class Estimator:
        def compute_groups(self, rewards, lengths):
            return rewards

    class Loop:
        judge_pool = None

        @staticmethod
        def rollout_metrics(samples):
            return {}

    class Pool:
        pending = 0

        async def cancel_pending(self, grace_s):
            return 0

    class Backend:
        accepts_live_weights = True

    class Loss:
        ratio_only = False

    class Checked:
        @classmethod
        def check_config(cls, cfg):
            return []

        @classmethod
        def check_recipe(cls, recipe):
            return []

    for obj, proto in [(Sampler(), Shardable), (Estimator(), ComputesGroups), (Loop(), ReportsRolloutMetrics),
                       (Loop(), HasJudgePool), (Pool(), CancelsJudging), (Backend(), AcceptsLiveWeights),
                       (Loss(), RatioOnly), (Checked, ChecksConfig), (Checked, ChecksRecipe)]:
        assert isinstance(obj, proto), proto.__name__
        assert _new(obj, proto) == _old(obj, proto), proto.__name__
        assert not isinstance(object(), proto), proto.__name__

    class Opted:
        check_config = None  # explicitly without: as getattr(..., None) read it

    assert not isinstance(Opted, ChecksConfig)


def test_callers_use_a_duck_typed_capability():
    """The callers act on a duck-typed class's capability: ``compute_groups`` is called, a
    ``ratio_only`` loss lets the head gradient be computed ahead."""
    from rlcli.config import TrainWorkerConfig
    from rlcli.runner.sequences import sequences_from_groups
    from rlcli.train.step_loss import head_grad_ahead
    from rlcli.types import Group, Sample, Status

    class Batched:
        def compute(self, rewards, lengths=None):
            raise AssertionError("compute_groups is there: compute is not called")

        def compute_groups(self, rewards, lengths):
            return [[7.0] * len(r) for r in rewards]

    s = Sample(uid=0, group_id=0, task_name="t", prompt_ids=[1], response_ids=[2], logprobs=[-1.0],
               response_mask=[1], token_versions=[0], status=Status.COMPLETED, reward={"score": 1.0})
    _, adv = sequences_from_groups([Group(group_id=0, task_name="t", samples=[s])], Batched())
    assert adv == [7.0]

    class Ratio:
        ratio_only = True

    cfg = TrainWorkerConfig(head_grad_in_forward=True)
    assert head_grad_ahead(cfg, Ratio()) and not head_grad_ahead(cfg, object())


# --------------------------------------------------------------------------- no probing by name
CAPABILITY_NAMES = set().union(*(members(p) for p in CAPABILITIES))
PROBES = {"getattr", "hasattr"}


def name_probes(source: str, names: set[str]) -> list[tuple[int, str, str]]:
    """``(line, function, name)`` of each ``getattr``/``hasattr`` call whose attribute is a string
    literal in ``names``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in names):
            found.append((node.lineno, node.func.id, node.args[1].value))
    return found


def _sources() -> list[Path]:
    files = sorted((REPO / "rlcli").rglob("*.py"))
    for pkg in sorted((REPO / "plugins").glob("*/rlcli_*")):
        files += sorted(pkg.rglob("*.py"))
    return files


def test_the_scan_finds_probes():
    snippet = 'a = getattr(x, "shard", None)\nb = hasattr(y, "ratio_only")\nc = getattr(z, "name", "")\n'
    assert name_probes(snippet, CAPABILITY_NAMES) == [(1, "getattr", "shard"), (2, "hasattr", "ratio_only")]
    assert {"accepts_live_weights", "compute_groups", "ratio_only", "shard", "rollout_metrics", "judge_pool",
            "pending", "cancel_pending", "check_config", "check_recipe"} <= CAPABILITY_NAMES
    # it reads the real tree: the getattr calls that remain there (third-party objects) are seen
    total = sum(len(name_probes(p.read_text(), {"name"})) for p in _sources())
    assert total > 0 and len(_sources()) > 50


def test_no_capability_is_probed_by_name():
    """Optional capabilities are asked for with ``isinstance(x, Protocol)`` (see rlcli/component.py)."""
    bad = [f"{p.relative_to(REPO)}:{line}: {fn}(..., {name!r})"
           for p in _sources() for line, fn, name in name_probes(p.read_text(), CAPABILITY_NAMES)]
    assert not bad, "probe a capability with its Protocol from rlcli.component, not by name:\n" + "\n".join(bad)


def test_docs_list_every_capability():
    text = (REPO / "docs" / "plugins.md").read_text()
    section = text.partition("## Optional capabilities")[2]
    assert section, "docs/plugins.md has no 'Optional capabilities' section"
    listed = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert listed == [p.__name__ for p in CAPABILITIES]
