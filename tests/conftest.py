import pytest
import torch

from functrans import _levels


def pytest_configure(config):
    config.addinivalue_line("markers", "sweep: the full OpInfo sweep (long; run with -m sweep)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device")


@pytest.fixture(autouse=True)
def _clean_levels_and_seed():
    torch.manual_seed(0)
    yield
    assert _levels.stack() == [], f"a transform leaked levels: {_levels.stack()}"


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        params = [pytest.param("cpu", id="cpu"),
                  pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
                      not torch.cuda.is_available(), reason="no CUDA device"))]
        metafunc.parametrize("device", params)
