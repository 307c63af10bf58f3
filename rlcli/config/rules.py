"""The cross-field rules, checked over the raw recipe dict (also when the models reject it)."""

from __future__ import annotations

from rlcli.config.issues import Issue
from rlcli.config.placement import _check_disaggregated


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
        _check_logprobs_for_rollout_is(raw, tasks, issues)
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
        if isinstance(m.get("path"), str):
            _check_location(m["path"], "model.path", "model", issues)
        tok = m.get("tokenizer")
        if isinstance(tok, str) and tok.startswith("builtin:"):
            from rlcli.tokenizer import BUILTIN_TOKENIZERS

            if tok[len("builtin:"):] not in BUILTIN_TOKENIZERS:
                issues.append(Issue("model.tokenizer", f"unknown built-in tokenizer {tok!r}; available: "
                                    + ", ".join(f"builtin:{n}" for n in sorted(BUILTIN_TOKENIZERS))))
        elif isinstance(tok, str):
            _check_location(tok, "model.tokenizer", "tokenizer", issues)


def _check_logprobs_for_rollout_is(raw: dict, tasks: list, issues: list[Issue]) -> None:
    """train_worker.rollout_is weighs tokens by the engine's logprobs: every training task must return them."""
    tw = raw.get("train_worker")
    if not isinstance(tw, dict) or tw.get("rollout_is") is None:
        return
    for i, t in enumerate(tasks):
        loop = t.get("agent_loop") if isinstance(t, dict) else None
        params = loop.get("sample_params") if isinstance(loop, dict) else None
        if isinstance(params, dict) and params.get("return_logprob") is False:
            issues.append(Issue(f"tasks.{i}.agent_loop.sample_params.return_logprob",
                                "train_worker.rollout_is needs the engine's logprob of every response token; "
                                "set return_logprob true or unset train_worker.rollout_is"))


def _check_location(spec: str, field: str, need, issues: list[Issue]) -> None:
    """A directory or a Hub id (cached, or online), checked without downloading weights."""
    from rlcli.hub import ModelLocationError, locate

    try:
        locate(spec, field=field, need=need, download=False)
    except ModelLocationError as exc:
        issues.append(Issue(field, exc.message))


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
