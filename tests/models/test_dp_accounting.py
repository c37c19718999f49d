"""Privacy accounting (functrans.nn.dp_accounting) and Poisson sampling (functrans.nn.poisson).

References: Opacus itself. The ε of ``privacy_spent`` is compared with what an Opacus
``PrivacyEngine`` reports (``get_epsilon(delta)``) after k real training steps with the same
noise multiplier and sample rate, and with Opacus's accountants called step by step; the noise
multiplier of ``noise_for_epsilon`` with Opacus's ``get_noise_multiplier`` and with the ε it
gives back.  The sampler is checked against Opacus's ``UniformWithReplacementSampler`` (the same
batches from the same generator state) and statistically (mean batch size N*q, inclusion
frequency q per example, with tolerances of about 6 standard deviations; the draws are seeded).
"""
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from functrans.errors import MissingDependencyError, TransformArgumentError
from functrans.nn import dp
from functrans.nn.dp import (PoissonSampler, PrivacyLedger, dp_sgd_grads, noise_for_epsilon,
                             poisson_data_loader, privacy_spent)

DELTA = 1e-5
GDP_WARNING = "ignore:GDP accounting is experimental"


def _opacus_accountant(name):
    pytest.importorskip("opacus")
    from opacus.accountants import create_accountant
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # GaussianAccountant warns that GDP is experimental
        return create_accountant(mechanism=name)


# ------------------------------------------------------------------------------ ε vs Opacus
@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_epsilon_equals_an_opacus_privacy_engine_run(accountant):
    pytest.importorskip("opacus")
    from opacus import PrivacyEngine
    torch.manual_seed(0)
    n, batch_size, sigma, steps = 40, 4, 1.3, 7
    data = torch.utils.data.TensorDataset(torch.randn(n, 3), torch.randint(0, 2, (n,)))
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Opacus's note that secure_mode is off
        engine = PrivacyEngine(accountant=accountant)
        model, opt, loader = engine.make_private(module=model, optimizer=opt,
                                                 data_loader=loader, noise_multiplier=sigma,
                                                 max_grad_norm=1.0)
        taken = 0
        while taken < steps:
            for x, y in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                taken += 1
                if taken == steps:
                    break
    sample_rate = 1 / (n // batch_size)   # Opacus's Poisson loader: 1 / len(data_loader)
    assert loader.sample_rate == sample_rate
    assert engine.accountant.history == [(sigma, sample_rate, steps)]   # k steps were counted
    expected = engine.get_epsilon(DELTA)
    assert expected > 0
    got = privacy_spent(noise_multiplier=sigma, sample_rate=sample_rate, steps=steps,
                        delta=DELTA, accountant=accountant)
    assert got == pytest.approx(expected, rel=1e-12)
    ledger = PrivacyLedger(accountant)
    for _ in range(steps):
        ledger.step(noise_multiplier=sigma, sample_rate=sample_rate)
    assert ledger.epsilon(DELTA) == pytest.approx(expected, rel=1e-12)


@pytest.mark.filterwarnings(GDP_WARNING)
@pytest.mark.parametrize("accountant", ["rdp", "prv", "gdp"])
@pytest.mark.parametrize("sigma,q,steps", [(1.1, 256 / 60000, 500), (0.8, 0.02, 120),
                                           (2.0, 0.5, 10)])
def test_epsilon_equals_the_opacus_accountant_stepped(accountant, sigma, q, steps):
    acc = _opacus_accountant(accountant)
    for _ in range(steps):
        acc.step(noise_multiplier=sigma, sample_rate=q)
    expected = acc.get_epsilon(delta=DELTA)
    got = privacy_spent(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=DELTA,
                        accountant=accountant)
    assert isinstance(got, float) and got == pytest.approx(expected, rel=1e-12)


def test_epsilon_grows_with_steps_and_shrinks_with_noise():
    pytest.importorskip("opacus")
    eps = lambda sigma, steps: privacy_spent(noise_multiplier=sigma, sample_rate=0.01,  # noqa
                                             steps=steps, delta=DELTA)
    assert eps(1.0, 0) == 0.0
    assert 0 < eps(1.0, 100) < eps(1.0, 1000)
    assert eps(2.0, 1000) < eps(1.0, 1000)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
@pytest.mark.parametrize("target", [0.5, 3.0])
def test_noise_for_epsilon_round_trips(accountant, target):
    pytest.importorskip("opacus")
    from opacus.accountants.utils import get_noise_multiplier
    q, steps = 0.01, 300
    sigma = noise_for_epsilon(target_epsilon=target, sample_rate=q, steps=steps, delta=DELTA,
                              accountant=accountant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert sigma == get_noise_multiplier(target_epsilon=target, target_delta=DELTA,
                                             sample_rate=q, steps=steps, accountant=accountant)
    eps = privacy_spent(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=DELTA,
                        accountant=accountant)
    assert target - 0.01 <= eps <= target
    # a tighter tolerance, a closer ε
    sigma_tight = noise_for_epsilon(target_epsilon=target, sample_rate=q, steps=steps,
                                    delta=DELTA, accountant=accountant, epsilon_tolerance=1e-4)
    eps_tight = privacy_spent(noise_multiplier=sigma_tight, sample_rate=q, steps=steps,
                              delta=DELTA, accountant=accountant)
    assert target - 1e-4 <= eps_tight <= target


def test_noise_for_epsilon_target_out_of_reach_names_target_epsilon():
    pytest.importorskip("opacus")
    with pytest.raises(TransformArgumentError, match=r"^noise_for_epsilon\(target_epsilon="
                                                     r".*target_epsilon=1e-09.*raise"):
        noise_for_epsilon(target_epsilon=1e-9, sample_rate=1.0, steps=10_000, delta=1e-10)


# ------------------------------------------------------------------------------ the ledger
def test_ledger_reports_epsilon_per_epoch_like_privacy_spent():
    pytest.importorskip("opacus")
    ledger = PrivacyLedger()
    assert ledger.epsilon(DELTA) == 0.0 and len(ledger) == 0
    per_epoch = []
    for epoch in range(1, 4):
        ledger.step(noise_multiplier=1.0, sample_rate=0.05, steps=20)
        per_epoch.append(ledger.epsilon(DELTA))
        assert per_epoch[-1] == privacy_spent(noise_multiplier=1.0, sample_rate=0.05,
                                              steps=20 * epoch, delta=DELTA)
    assert per_epoch == sorted(per_epoch) and len(set(per_epoch)) == 3
    assert len(ledger) == 60 and ledger.history == [(1.0, 0.05, 60)]
    assert repr(ledger) == "PrivacyLedger(accountant='rdp', steps=60)"


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_ledger_with_changing_noise_equals_the_accountant(accountant):
    acc = _opacus_accountant(accountant)
    ledger = PrivacyLedger(accountant)
    for sigma, q, steps in [(1.5, 0.02, 30), (0.9, 0.02, 10), (0.9, 0.04, 5)]:
        ledger.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
        for _ in range(steps):
            acc.step(noise_multiplier=sigma, sample_rate=q)
    assert ledger.history == [(1.5, 0.02, 30), (0.9, 0.02, 10), (0.9, 0.04, 5)]
    assert ledger.accountant.history == acc.history
    assert ledger.epsilon(DELTA) == pytest.approx(acc.get_epsilon(delta=DELTA), rel=1e-12)


@pytest.mark.filterwarnings(GDP_WARNING)
def test_gdp_ledger_refuses_a_changing_noise_multiplier():
    pytest.importorskip("opacus")
    ledger = PrivacyLedger("gdp")
    ledger.step(noise_multiplier=1.0, sample_rate=0.01)
    with pytest.raises(TransformArgumentError, match=r"^PrivacyLedger\.step\(.*'gdp'.*same "
                                                     r"noise_multiplier"):
        ledger.step(noise_multiplier=2.0, sample_rate=0.01)


# ------------------------------------------------------------------------------ argument errors
GOOD = dict(noise_multiplier=1.0, sample_rate=0.01, steps=100, delta=1e-5)


@pytest.mark.parametrize("name,value", [
    ("noise_multiplier", 0.0), ("noise_multiplier", -1.0), ("noise_multiplier", float("nan")),
    ("noise_multiplier", "1.0"), ("sample_rate", 0.0), ("sample_rate", 1.5),
    ("sample_rate", -0.1), ("delta", 0.0), ("delta", 1.0), ("delta", 2e-5j), ("steps", -1),
    ("steps", 2.5), ("steps", True), ("accountant", "moments"), ("accountant", None),
])
def test_privacy_spent_argument_errors_name_the_argument(name, value):
    # checked before Opacus is imported: these errors need no Opacus
    with pytest.raises(TransformArgumentError,
                       match=rf"^privacy_spent\(noise_multiplier=.*\): {name} must "):
        privacy_spent(**{**GOOD, name: value})


@pytest.mark.parametrize("name,value", [
    ("target_epsilon", 0.0), ("target_epsilon", -2.0), ("target_epsilon", float("inf")),
    ("sample_rate", 0.0), ("steps", 0), ("delta", 1.0), ("accountant", "RDP"),
    ("epsilon_tolerance", 0.0),
])
def test_noise_for_epsilon_argument_errors_name_the_argument(name, value):
    good = dict(target_epsilon=2.0, sample_rate=0.01, steps=100, delta=1e-5)
    with pytest.raises(TransformArgumentError,
                       match=rf"^noise_for_epsilon\(target_epsilon=.*\): {name} must "):
        noise_for_epsilon(**{**good, name: value})


def test_ledger_argument_errors_name_the_argument():
    with pytest.raises(TransformArgumentError, match=r"^PrivacyLedger\(accountant='x'\): "
                                                     r"accountant must be one of"):
        PrivacyLedger("x")
    pytest.importorskip("opacus")
    ledger = PrivacyLedger()
    with pytest.raises(TransformArgumentError, match=r"noise_multiplier must be > 0"):
        ledger.step(noise_multiplier=0.0, sample_rate=0.1)
    with pytest.raises(TransformArgumentError, match=r"sample_rate must be in \(0, 1\]"):
        ledger.step(noise_multiplier=1.0, sample_rate=2.0)
    with pytest.raises(TransformArgumentError, match=r"delta must be in \(0, 1\)"):
        ledger.epsilon(0.0)
    assert len(ledger) == 0   # the refused steps were not recorded


def test_without_opacus_the_error_says_what_to_install(monkeypatch):
    for name in ("opacus", "opacus.accountants", "opacus.accountants.utils"):
        monkeypatch.setitem(sys.modules, name, None)   # `import opacus...` now fails
    for call in (lambda: privacy_spent(**GOOD), lambda: PrivacyLedger(),
                 lambda: noise_for_epsilon(target_epsilon=1.0, sample_rate=0.1, steps=10,
                                           delta=1e-5)):
        with pytest.raises(MissingDependencyError,
                           match=r"pip install --no-deps opacus==1\.6\.0 scipy opt_einsum") as e:
            call()
        assert isinstance(e.value, ImportError) and "functrans[dp]" in str(e.value)


def test_importing_functrans_does_not_import_opacus():
    code = ("import sys, functrans, functrans.nn.dp; "
            "assert 'opacus' not in sys.modules, 'opacus imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_names_are_exported_from_nn_and_dp():
    import functrans.nn as ftnn
    for name in ("privacy_spent", "noise_for_epsilon", "PrivacyLedger", "PoissonSampler",
                 "poisson_data_loader"):
        assert getattr(ftnn, name) is getattr(dp, name)
        assert name in dp.__all__ and name in ftnn.__all__


# ------------------------------------------------------------------------------ Poisson sampling
def test_sampler_is_reproducible_from_a_seed_and_advances_its_generator():
    a = [idx.tolist() for idx in PoissonSampler(50, 0.1, steps=30, seed=7)]
    b = [idx.tolist() for idx in PoissonSampler(50, 0.1, steps=30, seed=7)]
    assert a == b
    assert a != [idx.tolist() for idx in PoissonSampler(50, 0.1, steps=30, seed=8)]
    gen = torch.Generator().manual_seed(7)
    sampler = PoissonSampler(50, 0.1, steps=30, generator=gen)
    first, second = [i.tolist() for i in sampler], [i.tolist() for i in sampler]
    assert first == a and second != first   # a second pass (epoch) draws new batches
    assert len(sampler) == 30 and len(PoissonSampler(50, 0.1)) == 10   # default: 1 / q


def test_sampler_draws_the_batches_of_opacus_sampler():
    pytest.importorskip("opacus")
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler
    ours = PoissonSampler(37, 0.2, steps=25, generator=torch.Generator().manual_seed(3))
    theirs = UniformWithReplacementSampler(num_samples=37, sample_rate=0.2, steps=25,
                                           generator=torch.Generator().manual_seed(3))
    assert [idx.tolist() for idx in ours] == list(theirs)


def test_sampler_index_tensors_are_sorted_unique_and_in_range():
    for idx in PoissonSampler(30, 0.5, steps=20, seed=0):
        assert idx.dtype == torch.int64 and idx.dim() == 1
        values = idx.tolist()
        assert values == sorted(set(values)) and all(0 <= v < 30 for v in values)


def test_sampler_draws_empty_batches_and_dp_sgd_takes_them():
    sampler = PoissonSampler(5, 0.1, steps=200, seed=0)   # P(empty) = 0.9**5 = 0.59
    sizes = [len(idx) for idx in sampler]
    assert sizes.count(0) > 50 and max(sizes) >= 2
    # the data loader collates an empty batch to zero-row tensors; DP-SGD's sum is the noise
    x, y = torch.randn(5, 3), torch.arange(5) % 2
    loader = poisson_data_loader(torch.utils.data.TensorDataset(x, y), sample_rate=0.1,
                                 steps=200, seed=0)
    batches = list(loader)
    assert [len(b[1]) for b in batches] == sizes
    empty = next(b for b in batches if len(b[1]) == 0)
    assert empty[0].shape == (0, 3) and empty[1].dtype == y.dtype
    model = nn.Linear(3, 2)
    grads = dp_sgd_grads(model, nn.functional.cross_entropy, tuple(empty), max_norm=1.0,
                         noise_multiplier=1.0, seed=4)
    noise = dp.add_gaussian_noise({n: torch.zeros_like(p) for n, p in model.named_parameters()},
                                  1.0, seed=4)
    for name in noise:
        torch.testing.assert_close(grads[name], noise[name])


def test_sampler_mean_batch_size_and_inclusion_frequency_are_n_times_q():
    n, q, steps = 200, 0.05, 2000
    sampler = PoissonSampler(n, q, steps=steps, seed=11)
    counts = torch.zeros(n)
    sizes = []
    for idx in sampler:
        counts[idx] += 1
        sizes.append(len(idx))
    sizes = torch.tensor(sizes, dtype=torch.float64)
    assert sampler.expected_batch_size == n * q
    # batch size ~ Binomial(n, q): mean n q = 10 (std of the mean over 2000 steps: 0.07),
    # variance n q (1 - q) = 9.5
    assert abs(sizes.mean().item() - n * q) < 0.4
    assert abs(sizes.var().item() - n * q * (1 - q)) < 2.5
    # each example joins a step with probability q (std of a frequency over 2000 steps: 0.005)
    freq = counts / steps
    assert (freq - q).abs().max().item() < 0.03
    assert abs(freq.mean().item() - q) < 0.002


def test_data_loader_batches_are_the_sampler_indices():
    data = torch.utils.data.TensorDataset(torch.arange(60.0).reshape(20, 3), torch.arange(20))
    loader = poisson_data_loader(data, sample_rate=0.25, steps=12, seed=5)
    assert isinstance(loader.batch_sampler, PoissonSampler)
    assert loader.batch_sampler.expected_batch_size == 5.0
    expected = [idx for idx in PoissonSampler(20, 0.25, steps=12, seed=5)]
    for (x, y), idx in zip(loader, expected, strict=True):
        assert torch.equal(y, idx) and torch.equal(x, data.tensors[0][idx])
    # a plain list dataset works too (indices are 0-d tensors, usable as list indices)
    rows = [(torch.tensor([float(i)]), i) for i in range(8)]
    for x, y in poisson_data_loader(rows, sample_rate=0.5, steps=4, seed=1):
        assert torch.equal(x[:, 0], y.float())


@pytest.mark.parametrize("kwargs,name", [
    (dict(num_samples=0, sample_rate=0.1), "num_samples"),
    (dict(num_samples=10, sample_rate=0.0), "sample_rate"),
    (dict(num_samples=10, sample_rate=1.01), "sample_rate"),
    (dict(num_samples=10, sample_rate=0.1, steps=-1), "steps"),
    (dict(num_samples=10, sample_rate=0.1, seed=1, generator=torch.Generator()), "generator="),
])
def test_sampler_argument_errors_name_the_argument(kwargs, name):
    with pytest.raises(TransformArgumentError, match=rf"^PoissonSampler\(.*\): .*{name}"):
        PoissonSampler(kwargs.pop("num_samples"), **kwargs)


def test_data_loader_refuses_a_batch_size():
    data = torch.utils.data.TensorDataset(torch.zeros(4, 1))
    with pytest.raises(TransformArgumentError, match=r"\['batch_size', 'shuffle'\] cannot"):
        poisson_data_loader(data, sample_rate=0.5, batch_size=2, shuffle=True)
