import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


# Torch threads per test process. Tiny models gain little from a second thread, and a thread that waits for a core
# another process holds stalls every parallel op: beside one busy process on a 2-core machine, test_bench's run of
# the tiny pair took 100 s at 2 threads and 18 s at 1 (16 s either way when idle). So each process takes its share
# of the cores, at most 2: under pytest-xdist (-n) two workers on 2 cores run a thread each, and the processes the
# tests start take the same share. SPECHEADS_TEST_THREADS=1 beside a training run.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = int(os.environ.get("SPECHEADS_TEST_THREADS", max(1, min(2, _cores() // WORKERS))))
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))


def pytest_configure(config):
    """Set up a process that runs tests. Under pytest-xdist (-n) the controller runs none: it skips importing torch here
    (2-3 s before the workers start), which each worker does for itself."""
    if config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput"):
        return
    import torch

    torch.set_num_threads(THREADS)


@pytest.fixture(scope="session", autouse=True)
def _pycode_prompts_once():
    """pycode's prompts of a split, cut from the stdlib once a process: a bench, a plan and a labelling run each read
    them (2 s a split on a 2-core CPU, 11 reads a session). The records are the same; callers get their own copies.
    A fixture, so a process that runs no test (the cuda-marked run on a CPU: all skipped) does not import datasets."""
    import functools

    from data_gen import prompts

    original = prompts.pycode_records
    read = functools.cache(original)
    prompts.pycode_records = functools.wraps(original)(lambda split: [dict(r) for r in read(split)])
    yield
    prompts.pycode_records = original


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run without the plugin (-p no:xdist) has no such hook
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core this process may use (xdist would count physical cores where psutil is
    installed: one on a 2-vCPU machine whose vCPUs are hyperthreads), at most 8: past that the suite's longest test
    (test_gpucheck's CPU run, about a minute) sets the time, and each worker imports torch and Lightning again."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return max(1, min(8, _cores()))


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the slow tests (several processes, the committed pair) go out first, so that the last
    test a worker takes is a short one and neither waits long for the other at the end."""
    if hasattr(config, "workerinput"):  # this process is an xdist worker
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _threads_back():
    """A command run in this process may set its own thread count (the bench, decode's CLI): the next test runs at
    the suite's again."""
    import torch

    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


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
