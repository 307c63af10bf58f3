import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from rlcli.models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_4k(tmp_path_factory) -> Path:
    """``tiny_llama`` with 4096 positions: room for the GSM8K recipes' prompt + response lengths,
    which ``validate`` checks against the model's config.json."""
    from rlcli.models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama4k", arch="llama", seed=0,
                          max_position_embeddings=4096)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
