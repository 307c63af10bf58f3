"""Task batch split (XTuner behaviours 1-4)."""

import pytest

from rlcli.manager import allocate_task_batch_sizes


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
