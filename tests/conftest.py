import pytest
import torch

from tests.harness.collector import collect_less
from tests.harness.slow import SLOW_FILES, longest_first

torch.set_num_threads(1)  # device threads already run side by side on this machine's 2 cores


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the slow files' tests `slow`, and run the longest files first (pytest-xdist hands files
    to its workers in this order)."""
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: longest_first(item.path.name))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module is imported: freeze what they imported and collect less often (tests/harness/collector.py)."""
    collect_less()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
