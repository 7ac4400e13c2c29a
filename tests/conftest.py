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


@pytest.fixture(scope="session")
def arch_pair_cache(tmp_path_factory):
    """(family, dtype, device) -> (pair YAML, loaded pair) of tests/archs.py's tiny random pairs, each built once a
    session (tests.test_archs.arch_pairs hands it to test_archs, test_batch, test_tree and test_rowcache). Tests
    that change a pair do so on a copy (dataclasses.replace, with_sampling), never in place."""
    from decode.pair import load_pair
    from tests.archs import write_arch_pair

    cache = {}

    def get(family, dtype, device="cpu"):
        if (family, dtype, device) not in cache:
            yaml_path = write_arch_pair(tmp_path_factory.mktemp(f"{family}-{dtype}"), family, dtype)
            cache[family, dtype, device] = (yaml_path, load_pair(yaml_path, device=device))
        return cache[family, dtype, device]

    return get
