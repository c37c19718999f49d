import pytest
import torch


@pytest.fixture
def float64():
    """Compare exactly in float64 (float32 is exercised by the OpInfo sweeps)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
