import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Each test draws fresh random inputs; the seed shows in the captured output of a failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"torch seed = {seed}")
    torch.manual_seed(seed)
    yield seed


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for modules of tiny models: faster than two, and steady on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
