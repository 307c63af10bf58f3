"""``rlcli new judger|agent-loop``: the packages it writes pip-install (into a target folder, never
this environment), appear in ``rlcli plugins``, pass their own tests (which run rlcli.testing's
kits), and validate and train for 2 steps from their generated recipes; bad requests exit 2."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from rlcli.cli import cli

NAMES = {"judger": "last-number", "agent-loop": "two_answers"}  # kind -> NAME (one with a dash)

# One interpreter runs the CLI commands one after the other (the imports are paid once): a
# JSON list of argument lists in, a JSON list of {args, exit_code, output} out.
DRIVER = """
import json, sys
from click.testing import CliRunner
from rlcli.cli import cli
results = [{"args": a, **(lambda r: {"exit_code": r.exit_code, "output": r.output})(CliRunner().invoke(cli, a))}
           for a in json.loads(sys.argv[1])]
print("RESULTS " + json.dumps(results))
"""


def _new(*args):
    return CliRunner().invoke(cli, ["new", *map(str, args)])


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Both kinds written by ``rlcli new``, installed by pip into one target folder: (root, env)."""
    root = tmp_path_factory.mktemp("new")
    for kind, name in NAMES.items():
        out = _new(kind, name, "--dir", root / kind)
        assert out.exit_code == 0, out.output
        assert f"wrote 7 files to {root / kind}/" in out.output
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "--no-compile", "--target", str(root / "site")]
    r = subprocess.run([*pip, *(str(root / kind) for kind in NAMES)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    path = os.pathsep.join(filter(None, [str(root / "site"), os.environ.get("PYTHONPATH")]))
    return root, {**os.environ, "PYTHONPATH": path}


def test_generated_packages_install_pass_their_tests_validate_and_train(installed):
    root, env = installed
    tests = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                              str(root / "judger" / "tests"), str(root / "agent-loop" / "tests")],
                             cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    recipes = {kind: root / kind / "recipes" / f"{name.replace('-', '_')}.yaml" for kind, name in NAMES.items()}
    commands = [["plugins"]]
    for kind, recipe in recipes.items():
        commands += [["validate", str(recipe)],
                     ["train", str(recipe), "--quiet", "--work-dir", str(root / f"run-{kind}"),
                      "trainer.total_train_steps=2", "trainer.train_batch_size=10"]]
    try:
        r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], cwd=root, env=env,
                           capture_output=True, text=True, timeout=300)
        test_output = tests.communicate(timeout=300)[0]
    finally:
        if tests.poll() is None:
            tests.kill()
            tests.wait()
    assert r.returncode == 0 and "RESULTS " in r.stdout, r.stdout + r.stderr
    (listed, *runs) = json.loads(r.stdout.split("RESULTS ", 1)[1])
    for res in [listed, *runs]:
        assert res["exit_code"] == 0, f"rlcli {' '.join(res['args'])}:\n{res['output']}"
    assert "  last_number " in listed["output"] and "rlcli-last-number 0.1.0" in listed["output"]
    assert "  two_answers " in listed["output"] and "rlcli-two-answers 0.1.0" in listed["output"]
    assert "tasks.0.judger: judger last_number" in runs[0]["output"]
    assert "tasks.0.agent_loop: agent_loop two_answers" in runs[2]["output"]
    for kind in NAMES:
        rows = [json.loads(x) for x in (root / f"run-{kind}" / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows] == [1, 2] and all(x["rollout/samples"] == 80 for x in rows), kind
    assert tests.returncode == 0 and "10 passed" in test_output, test_output


def test_new_refuses_a_bad_name_a_taken_name_and_a_folder_in_use(tmp_path):
    out = _new("judger", "9lives", "--dir", tmp_path / "a")
    assert out.exit_code == 2 and "invalid NAME '9lives'" in out.output and not (tmp_path / "a").exists()
    out = _new("agent-loop", "single_turn", "--dir", tmp_path / "b")
    assert out.exit_code == 2 and "agent_loop 'single_turn' already exists (from rlcli" in out.output
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    out = _new("judger", "fine", "--dir", used)
    assert out.exit_code == 2 and f"{used} exists and is not empty" in out.output
    assert [p.name for p in used.iterdir()] == ["notes.txt"] and (used / "notes.txt").read_text() == "mine"


def test_new_writes_into_an_empty_folder_or_the_default_one(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    assert _new("judger", "ok", "--dir", tmp_path / "empty").exit_code == 0
    assert (tmp_path / "empty" / "rlcli_ok" / "__init__.py").is_file()
    monkeypatch.chdir(tmp_path)
    out = _new("agent-loop", "rlcli-echo")  # the prefix is not doubled
    assert out.exit_code == 0, out.output
    assert (tmp_path / "rlcli-echo" / "rlcli_echo" / "__init__.py").is_file()
    assert 'echo = "rlcli_echo"' in (tmp_path / "rlcli-echo" / "pyproject.toml").read_text()
