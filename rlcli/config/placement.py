"""Rank placement of a disaggregated run: which launched ranks train and which roll out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from rlcli.config.issues import Issue

if TYPE_CHECKING:
    from rlcli.config.sections import Recipe


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
    """Problems of ``recipe`` launched on ``world_size`` ranks: colocated, every rank needs a group of
    every step (and every task a group on some rank); disaggregated, the placement."""
    if world_size < 1:
        return []  # the launcher reports it
    if recipe.trainer.mode != "disaggregated":
        from rlcli.config.fit import check_task_shares, rank_batch_sizes

        bs = recipe.trainer.train_batch_size
        if bs < world_size:
            return [Issue("trainer.train_batch_size", f"trainer.train_batch_size={bs} is smaller than the {world_size} "
                          "launched ranks (--nproc-per-node x --nnodes): every rank rolls out at least one group per "
                          f"step; raise it to at least {world_size} or launch fewer ranks")]
        why = f" on each of the {world_size} ranks" if world_size > 1 else ""
        return check_task_shares(recipe, rank_batch_sizes(bs, world_size), why)
    train, rollout, issues = resolve_placement(recipe.resources, world_size)
    if not issues and recipe.trainer.train_batch_size < len(rollout):
        issues.append(Issue("trainer.train_batch_size", f"trainer.train_batch_size={recipe.trainer.train_batch_size} "
                            f"is smaller than the {len(rollout)} ranks of {ROLLOUT_RESOURCES}: every rollout rank "
                            "produces at least one group per step"))
    return issues
