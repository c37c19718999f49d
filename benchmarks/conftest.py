"""Benchmarks run with one torch thread; each reports medians via pytest-benchmark.

Run: ``.venv/bin/python -m pytest benchmarks -q`` (ratios are printed by bench_report.py)."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)
