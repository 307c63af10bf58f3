import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from rlcli_vllm.logic import ENGINE  # noqa: E402


def gpu_skip_reason() -> str | None:
    """Why the tests that drive the real engine cannot run here (None when they can)."""
    import torch

    problem = ENGINE.problem()
    if problem is not None:
        return problem
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # conftest hooks see every item of the session: only this directory's tests are ours
    ours = [it for it in items if "gpu" in it.keywords and HERE in Path(str(it.path)).resolve().parents]
    reason = gpu_skip_reason() if ours else None
    if reason:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=reason), append=False)  # ours first: the most specific reason


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    from rlcli.models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("vllm-tiny") / "qwen2", arch="qwen2", seed=0)
