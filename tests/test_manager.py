"""Task batch split (XTuner behaviours 1-4) and manager validation.

Production itself (colocated and disaggregated) is tested in test_async_produce.py.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcli.produce.manager import allocate_task_batch_sizes


def test_split_by_weight():
    assert allocate_task_batch_sizes(96, {"math": 2, "code": 1}) == {"math": 64, "code": 32}
    assert allocate_task_batch_sizes(7, {"b": 1, "a": 2, "c": 0}) == {"b": 2, "a": 5, "c": 0}
    assert allocate_task_batch_sizes(10, {"x": 1, "y": 1, "z": 1}) == {"x": 4, "y": 3, "z": 3}
    assert allocate_task_batch_sizes(9, {"a": 2, "b": 1}) == {"a": 6, "b": 3}
    assert allocate_task_batch_sizes(0, {"a": 1}) == {"a": 0}


def test_split_errors():
    with pytest.raises(ValueError):
        allocate_task_batch_sizes(4, {"a": 0, "b": 0})
    with pytest.raises(ValueError):
        allocate_task_batch_sizes(-1, {"a": 1})


def test_split_examples_of_our_own():
    assert allocate_task_batch_sizes(5, {"a": 1, "b": 1}) == {"a": 3, "b": 2}  # tie: earlier task
    assert allocate_task_batch_sizes(5, {"b": 1, "a": 1}) == {"b": 3, "a": 2}  # config order, not name order
    assert allocate_task_batch_sizes(1, {"a": 1, "b": 3}) == {"a": 0, "b": 1}
    assert allocate_task_batch_sizes(100, {"a": 0.5, "b": 0.25, "c": 0.25}) == {"a": 50, "b": 25, "c": 25}
    with pytest.raises(ValueError, match="at least one task"):
        allocate_task_batch_sizes(3, {})


@settings(max_examples=300, deadline=None)
@given(batch=st.integers(0, 500), weights=st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=6))
def test_split_properties(batch, weights):
    w = {f"t{i}": x for i, x in enumerate(weights)}
    if sum(weights) <= 0:
        with pytest.raises(ValueError):
            allocate_task_batch_sizes(batch, w)
        return
    sizes = allocate_task_batch_sizes(batch, w)
    assert list(sizes) == list(w) and sum(sizes.values()) == batch
    total = sum(weights)
    for name, x in w.items():
        raw = batch * x / total
        assert math.floor(raw) <= sizes[name] <= math.ceil(raw)
        if x == 0:
            assert sizes[name] == 0


def test_manager_validates_tasks_and_custom_allocations():
    from types import SimpleNamespace

    from rlcli.produce.manager import RolloutManager
    from rlcli.replay_buffer import ReplayBuffer

    def task(name, weight=1.0):
        return SimpleNamespace(name=name, weight=weight)

    with pytest.raises(ValueError, match="at least one task"):
        RolloutManager([], ReplayBuffer(), None, [])
    with pytest.raises(ValueError, match="duplicate task name 'math'"):
        RolloutManager([task("math"), task("code"), task("math")], ReplayBuffer(), None, [])
    with pytest.raises(ValueError, match="weight must be positive"):
        RolloutManager([task("a", 0), task("b", 0)], ReplayBuffer(), None, [])
    m = RolloutManager([task("a"), task("b")], ReplayBuffer(), None, [], allocate=lambda bs, step: {"a": bs})
    with pytest.raises(ValueError, match="must give every task"):
        m.allocate(4, 1)
    m = RolloutManager([task("a"), task("b")], ReplayBuffer(), None, [], allocate=lambda bs, step: {"a": -1, "b": 5})
    with pytest.raises(ValueError, match="must give every task"):
        m.allocate(4, 1)
    m = RolloutManager([task("a", 2), task("b", 1)], ReplayBuffer(), None, [])
    assert m.allocate(9, 7) == {"a": 6, "b": 3}  # static: the step does not matter
