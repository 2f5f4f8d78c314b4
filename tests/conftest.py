import pytest
import torch

from tests.harness.slow import SLOW_FILES

torch.set_num_threads(1)  # device threads already run side by side on this machine's 2 cores


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
