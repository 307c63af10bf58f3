import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from rlcli.testing.engine_plugins import skip_gpu_tests_without_engine  # noqa: E402
from rlcli_sglang.logic import ENGINE  # noqa: E402

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    skip_gpu_tests_without_engine(ENGINE, items, HERE)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    from rlcli.models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("sglang-tiny") / "qwen2", arch="qwen2", seed=0)
