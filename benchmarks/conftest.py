"""pytest-benchmark settings: one torch thread on CPU; ``--bench-device cuda`` for a GPU."""
import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--bench-device", default="cpu", help="device for the benchmarks")


@pytest.fixture(scope="session")
def device(request):
    dev = torch.device(request.config.getoption("--bench-device"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if dev.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    return dev
