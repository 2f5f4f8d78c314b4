import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests.models`, `tests.reference`
torch.set_num_threads(1)  # device threads already run side by side on this machine's 2 cores


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
