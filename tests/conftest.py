import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("SPECHEADS_TEST_THREADS", "2")))  # 1 beside a training run


@pytest.fixture(scope="session")
def tiny_pair_yaml(tmp_path_factory):
    """Path of the YAML of a tiny random pair saved as real HF folders."""
    from tests.tiny import write_tiny_pair

    return write_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(scope="session")
def tiny_pair(tiny_pair_yaml):
    from decode.pair import load_pair

    return load_pair(tiny_pair_yaml)
