from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _reset_cuda_sync_debug_mode():
    """A GPU test that fails inside set_sync_debug_mode("error") must not fail every test after it."""
    yield
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("default")
