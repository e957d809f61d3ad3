import os
import sys

import torch

# Workers are forked from the test process. An OpenMP pool that ran in the parent can leave
# a forked child hanging at its first parallel region, so the whole suite runs single-threaded
# (2 cores, more ranks than cores: one thread per process is the fastest anyway).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _multi_process_tests_are_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tests.dist.run_distributed`` refuses to launch from a test not marked ``distributed``, so
    ``pytest -m "not distributed"`` is guaranteed to run one process only."""
    if request.node.get_closest_marker("distributed") is None:
        monkeypatch.setenv("MMPP_TEST_UNMARKED", request.node.nodeid)
