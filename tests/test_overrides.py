import pytest

from rlcli.overrides import OverrideError, apply_overrides


def test_set_nested_and_yaml_values():
    data = {"trainer": {"seed": 1}, "tasks": [{"judger": {"name": "a"}}]}
    out = apply_overrides(data, ["trainer.seed=3", "tasks.0.judger.name=gsm8k", "trainer.lr=1e-3",
                                 "trainer.flag=true", "trainer.lst=[1, 2]", "new.key.deep=x"])
    assert out["trainer"] == {"seed": 3, "lr": 1e-3, "flag": True, "lst": [1, 2]}
    assert out["tasks"][0]["judger"]["name"] == "gsm8k"
    assert out["new"] == {"key": {"deep": "x"}}
    assert data["trainer"]["seed"] == 1  # input untouched


def test_delete_and_append():
    data = {"a": {"b": 1, "c": 2}, "l": [1, 2, 3]}
    out = apply_overrides(data, ["~a.b", "~l.0", "l.2=9"])
    assert out == {"a": {"c": 2}, "l": [2, 3, 9]}


@pytest.mark.parametrize("ov, msg", [
    ("noequals", "key=value"),
    ("~a.zzz", "not found"),
    ("l.5=1", "out of range"),
    ("l.x=1", "integer index"),
    ("a..b=1", "dotted"),
    ("a.b.c=1", "cannot set"),
])
def test_errors_name_the_path(ov, msg):
    with pytest.raises(OverrideError, match=msg):
        apply_overrides({"a": {"b": 1}, "l": [1]}, [ov])
