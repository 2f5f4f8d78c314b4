import pytest
import torch

torch.set_num_threads(1)  # device threads already run side by side on this machine's 2 cores


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
