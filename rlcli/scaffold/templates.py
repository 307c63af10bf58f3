"""The files every ``rlcli new`` package shares, and what each kind fills in.

Texts hold ``{{key}}`` placeholders (:func:`rlcli.scaffold.render`): ``name`` (the component's
name in recipes, also the entry point's), ``dist``, ``module``, ``Class`` (the component's
class), ``Cls`` (the prefix of the other class names), ``kind``, ``kind_title``, ``hook``, and
the fields of :class:`KindTemplate` that the shared files take (``tokenizer``, ``recipe_task``,
``recipe_eval_task``, ``readme_yaml``, ``readme_text``; themselves rendered first).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KindTemplate:
    """What one kind puts into the shared files."""

    title: str  # "judger", "agent loop"
    registry_kind: str  # the kind's name in rlcli.plugins.KINDS
    hook: str  # the hook the module implements
    class_suffix: str  # "Judger", "Loop"
    module: str  # {module}/__init__.py
    tests: str  # tests/test_{name}.py
    tokenizer: str  # the recipe's built-in tokenizer
    recipe_task: str  # the training task's agent_loop and judger (indented 4)
    recipe_eval_task: str  # the eval task's (indented 6)
    readme_yaml: str  # the README's recipe snippet: the component's section of a task (indented 4)
    readme_text: str  # the README's words after that snippet


PYPROJECT = '''\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{{dist}}"
version = "0.1.0"
description = "rlcli {{kind_title}} plugin: {{name}}."
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["rlcli"]

[project.optional-dependencies]
test = ["pytest>=8"]

# How rlcli finds the plugin: an entry point in the `rlcli` group naming the module that
# implements the hook ({{hook}}).
[project.entry-points.rlcli]
{{name}} = "{{module}}"

[tool.setuptools]
packages = ["{{module}}"]

[tool.pytest.ini_options]
testpaths = ["tests"]
'''

GITIGNORE = '''\
__pycache__/
*.egg-info/
build/
dist/
work_dirs/
'''

README = '''\
# {{dist}}

An rlcli plugin that adds the `{{name}}` {{kind_title}}. It was written by `rlcli new {{kind}} {{name}}`
and works as it is: edit `{{module}}/__init__.py` to make it yours, and keep its tests passing.

## Install

```bash
pip install -e .      # from this folder
rlcli plugins         # lists {{kind_title}} '{{name}}' from {{dist}} 0.1.0
```

rlcli finds the plugin through the entry point in `pyproject.toml` (group `rlcli`); nothing else
to configure.

## Use

```yaml
tasks:
  - task_name: my_task
    sampler: {name: jsonl, path: data/my_task.jsonl, prompt_repeat_k: 8}
{{readme_yaml}}
```

{{readme_text}}

## Test

```bash
pytest
```

The tests check what the component computes and run rlcli's test kit for its kind
(`rlcli.testing`), which checks the contract every {{kind_title}} must keep; the last test passes
once the package is installed, when rlcli finds the component by name.

## Train with it

```bash
rlcli validate recipes/{{name}}.yaml
rlcli train recipes/{{name}}.yaml       # 50 steps, under a minute on a CPU; outputs in work_dirs/{{name}}/
rlcli train recipes/{{name}}.yaml trainer.total_train_steps=2 --work-dir /tmp/{{name}}-smoke
```

The recipe is rlcli's quickstart task (the last digit of `a + b`, 100 prompts in
`recipes/data/arith.jsonl`) with a from-scratch two-layer model and a built-in tokenizer: no
download. 50 steps show the run works; the quickstart trains its 300 (`trainer.total_train_steps=300`).
For real work set `model.path` to a Hugging Face model (and drop `model.from_scratch` and
`model.tokenizer`) and `sampler.path` to your data.
'''

RECIPE = '''\
description: The {{name}} {{kind_title}} on the quickstart's toy task (the last digit of a+b), CPU, under a minute.
# rlcli train recipes/{{name}}.yaml [trainer.total_train_steps=2 ...]
# Written by `rlcli new {{kind}} {{name}}`. No download: the model is random-init, the tokenizer
# is built in, the data is recipes/data/arith.jsonl (paths are relative to this file).

model:
  from_scratch: {arch: llama, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
                 num_key_value_heads: 2, intermediate_size: 128, max_position_embeddings: 64}
  tokenizer: {{tokenizer}}
  dtype: float32

trainer:
  total_train_steps: 50
  train_batch_size: 100          # prompt groups per step (all 100 problems)
  sync_weights_interval: 1
  seed: 1
  enable_evaluate: true
  enable_initial_evaluate: false
  evaluate_step: 25
  checkpoint_interval: 50
  checkpoint_maxkeep: 1
  work_dir: work_dirs/{{name}}
  log_every: 10

resources:
  device: cpu

rollout:
  name: embedded
  max_batch_size: 1024

train_worker:
  optimizer: {lr: 1.0e-3, weight_decay: 0.0}
  loss: {name: vanilla, clip_low: 0.2, clip_high: 0.2}
  max_grad_norm: 1.0

advantage: {name: grpo}
replay_buffer: {name: sync}

tasks:
  - task_name: arith
    sampler: {name: jsonl, path: data/arith.jsonl, prompt_repeat_k: 8}
{{recipe_task}}
    produce_strategy: {name: sync}

eval:
  tasks:
    - task_name: arith_eval
      sampler: {name: jsonl, path: data/arith.jsonl, prompt_repeat_k: 1, shuffle: false}
{{recipe_eval_task}}
  evaluator:
    metrics: [{name: accuracy}]
'''
