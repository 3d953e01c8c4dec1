import collections
import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.hookimpl(tryfirst=True)   # before ``-m`` deselects by the markers added here
def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET") == "1":
        _tier_interpreter_cases(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    config.pluginmanager.register(_LongTestsFirst(), "flexsparse-long-tests-first")


class _LongTestsFirst:
    """Orders the selected tests so that those marked ``long`` start at once on different xdist workers: each long
    test first, followed by one other test (xdist with ``--maxschedchunk=1``, as ``scripts/test.sh`` runs it, hands
    each worker two consecutive tests to begin with), then the rest as collected."""

    @pytest.hookimpl(trylast=True)   # after ``-m`` has deselected
    def pytest_collection_modifyitems(self, items):
        long = [item for item in items if "long" in item.keywords]
        others = [item for item in items if "long" not in item.keywords]
        paired = [test for pair in zip(long, others) for test in pair]
        items[:] = paired + long[len(others):] + others[len(long):]


def _tier_interpreter_cases(items):
    """Under the Triton interpreter, a test module's ``DEFAULT_TIER_CASES = n`` keeps the first n cases of each of
    its parametrized tests in the default tier and moves the others to the exhaustive one."""
    kept = collections.Counter()
    for item in items:
        cases = getattr(item.module, "DEFAULT_TIER_CASES", None)
        if cases is None or not hasattr(item, "callspec"):
            continue
        key = (item.module.__name__, item.originalname)
        if kept[key] >= cases:
            item.add_marker(pytest.mark.exhaustive)
        kept[key] += 1


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Each test draws fresh random inputs; the seed shows in the captured output of a failure, and
    ``FLEXSPARSE_TEST_SEED=<seed>`` replays it."""
    seed = int(os.environ.get("FLEXSPARSE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"torch seed = {seed}")
    torch.manual_seed(seed)
    yield seed


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(autouse=True)
def _write_analysis_succeeds():
    """Fail a test during which torch's analysis of a Triton kernel's writes failed: torch then takes every tensor
    argument as written (a warning only), compiled graphs copy them, and aliased ones came back wrong once
    (``test_triton_writes`` checks the kernels on CPU; this catches the GPU image's torch at work)."""
    logger, records = logging.getLogger("torch._higher_order_ops.triton_kernel_wrap"), _Records()
    logger.addHandler(records)
    yield
    logger.removeHandler(records)
    failed = [m for m in records.messages if m.startswith("Encountered an exception in identify")]
    if failed:
        pytest.fail(f"torch's write analysis of a Triton kernel failed {len(failed)} times: {failed[0]}")


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for modules of tiny models: faster than two, and steady on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_terminal_summary(terminalreporter):
    """Largest error per dtype and quantity over the tests that recorded ``errors`` (``record_property``),
    with the test holding it: the numbers a GPU run's summary reports."""
    worst = {}
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        for key, errors in getattr(report, "user_properties", ()):
            if key != "errors" or report.when != "call":
                continue
            for name, value in errors.items():
                slot = (errors["dtype"], name)
                if name != "dtype" and value > worst.get(slot, (-1.0, ""))[0]:
                    worst[slot] = (value, report.nodeid)
    if worst:
        terminalreporter.write_sep("-", "largest recorded errors")
        for (dtype, name), (value, test) in sorted(worst.items()):
            terminalreporter.write_line(f"{dtype:9} {name:12} {value:.2e}  {test}")
