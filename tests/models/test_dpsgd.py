"""DP-SGD (functrans.nn.dp): per-example clipping, noise, optimizer step, and 2 processes.

References: a per-example loop of torch.autograd.grad (clip, sum, the same noise from the same
seed), torch.func.vmap(grad) for the per-example gradients, and one process on the whole batch
for the distributed runs (tests/models/dp_worker.py, launched as 2 gloo processes).
"""
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from functrans.nn.dp import (CLIP_EPS, add_gaussian_noise, assign_grads, clip_and_sum,
                             dp_sgd_grads, per_sample_grads, surrogate_loss)


def _mlp():
    return nn.Sequential(nn.Linear(7, 10), nn.ReLU(), nn.Linear(10, 4))


def _cnn():
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(3 * 3 * 3, 4))


def _problem(kind, batch=6):
    torch.manual_seed(0)
    model = _mlp() if kind == "mlp" else _cnn()
    x = torch.randn(batch, 7) if kind == "mlp" else torch.randn(batch, 2, 6, 6)
    y = torch.randint(0, 4, (batch,))
    return model, x, y


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


def _loop_dp_sgd(model, x, y, max_norm, noise_multiplier, seed):
    """The recipe written out per example with autograd: the oracle."""
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(x.shape[0]):
        g = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params)
        norm = torch.sqrt(sum((gi ** 2).sum() for gi in g))
        factor = min(1.0, max_norm / (norm.item() + CLIP_EPS))
        total = [t + factor * gi for t, gi in zip(total, g)]
        norms.append(norm)
    gen = torch.Generator().manual_seed(seed)
    noisy = {n: t + noise_multiplier * max_norm * torch.randn(t.shape, generator=gen)
             for n, t in zip(names, total)}
    return noisy, torch.stack(norms)


def _close(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=k)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_per_sample_grads_match_reference(kind):
    import torch.func as tf
    model, x, y = _problem(kind)
    ours = per_sample_grads(model, loss_fn, (x, y))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p, xi, yi):
        return loss_fn(tf.functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))
    _close(ours, tf.vmap(tf.grad(f), in_dims=(None, 0, 0))(params, x, y))


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("max_norm", [0.05, 100.0])  # every example clipped / none clipped
def test_dp_sgd_grads_equal_per_example_loop(kind, max_norm):
    model, x, y = _problem(kind)
    ours, norms = dp_sgd_grads(model, loss_fn, (x, y), max_norm=max_norm, noise_multiplier=0.7,
                               seed=11, return_norms=True)
    ref, ref_norms = _loop_dp_sgd(model, x, y, max_norm, 0.7, seed=11)
    _close(ours, ref)
    torch.testing.assert_close(norms, ref_norms, atol=1e-5, rtol=1e-4)
    assert (norms > max_norm).all() if max_norm < 1 else (norms < max_norm).all()
    mean = dp_sgd_grads(model, loss_fn, (x, y), max_norm=max_norm, noise_multiplier=0.7,
                        generator=torch.Generator().manual_seed(11), reduction="mean")
    _close(mean, {k: v / x.shape[0] for k, v in ref.items()})


def _flat_norm(grads):
    return torch.sqrt(sum((g ** 2).sum() for g in grads.values()))


def test_clipping_bounds_each_examples_contribution():
    model, x, y = _problem("mlp")
    max_norm = 0.1
    per = per_sample_grads(model, loss_fn, (x, y))
    # every single example's clipped gradient has total norm <= max_norm (and == when clipped)
    for i in range(x.shape[0]):
        one, norm = clip_and_sum({k: g[i:i + 1] for k, g in per.items()}, max_norm)
        assert _flat_norm(one) <= max_norm
        if norm.item() > max_norm:
            assert _flat_norm(one) > max_norm * (1 - 1e-4)
    # replacing one example by an outlier moves the clipped sum by at most 2 * max_norm
    # (the sensitivity DP-SGD relies on), although the raw gradient moves by far more
    base, _ = clip_and_sum(per, max_norm)
    x2, y2 = x.clone(), y.clone()
    x2[2] = 1e3 * torch.randn(7)
    y2[2] = (y[2] + 1) % 4
    per2 = per_sample_grads(model, loss_fn, (x2, y2))
    moved, _ = clip_and_sum(per2, max_norm)
    raw_move = _flat_norm({k: per2[k].sum(0) - per[k].sum(0) for k in per})
    assert raw_move > 10 * max_norm
    assert _flat_norm({k: moved[k] - base[k] for k in base}) <= 2 * max_norm + 1e-6


def test_noise_has_the_right_scale_and_is_reproducible():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(60, 200), nn.Tanh(), nn.Linear(200, 50))  # ~22k coordinates
    x, y = torch.randn(4, 60), torch.randint(0, 50, (4,))
    max_norm, sigma = 0.3, 1.7
    clean = dp_sgd_grads(model, loss_fn, (x, y), max_norm=max_norm, noise_multiplier=0.0)
    noisy = dp_sgd_grads(model, loss_fn, (x, y), max_norm=max_norm, noise_multiplier=sigma,
                         seed=5)
    noise = torch.cat([(noisy[k] - clean[k]).reshape(-1) for k in clean])
    n, std = noise.numel(), sigma * max_norm
    # sample mean ~ N(0, std^2/n), sample std ~ std * (1 +- 1/sqrt(2n)): 6 standard errors
    assert noise.mean().abs() < 6 * std / n ** 0.5
    assert abs(noise.std().item() / std - 1) < 6 / (2 * n) ** 0.5
    # Gaussian shape: about 68.3% of the coordinates within one std
    assert abs((noise.abs() < std).double().mean().item() - 0.6827) < 6 * (0.22 / n) ** 0.5
    again = dp_sgd_grads(model, loss_fn, (x, y), max_norm=max_norm, noise_multiplier=sigma,
                         seed=5)
    _close(noisy, again, atol=0)
    other = dp_sgd_grads(model, loss_fn, (x, y), max_norm=max_norm, noise_multiplier=sigma,
                         seed=6)
    assert not torch.allclose(noisy["0.weight"], other["0.weight"])
    # the noise does not depend on the data: same seed, different batch, same noise
    noise2 = add_gaussian_noise({k: torch.zeros_like(v) for k, v in clean.items()}, std, seed=5)
    torch.testing.assert_close(torch.cat([v.reshape(-1) for v in noise2.values()]), noise,
                               atol=1e-5, rtol=0)


def test_assign_grads_lets_any_optimizer_step_and_skips_frozen_params():
    model, x, y = _problem("mlp")
    model[0].bias.requires_grad_(False)
    grads = dp_sgd_grads(model, loss_fn, (x, y), max_norm=0.5, noise_multiplier=1.0, seed=3,
                         reduction="mean")
    assert "0.bias" not in grads
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    assign_grads(model, grads)
    opt.step()
    for k, v in model.named_parameters():
        expected = before[k] - 0.2 * grads[k] if k in grads else before[k]
        torch.testing.assert_close(v.detach(), expected, msg=k)
    # surrogate_loss: its backward puts scale * grads into p.grad
    model.zero_grad(set_to_none=True)
    surrogate_loss(model, grads, scale=2.0).backward()
    for k, p in model.named_parameters():
        if k in grads:
            torch.testing.assert_close(p.grad, 2.0 * grads[k], msg=k)


def test_dropout_gets_a_mask_per_example():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 64), nn.Dropout(0.5), nn.Linear(64, 3))
    x, y = torch.randn(1, 5).expand(4, 5), torch.zeros(4, dtype=torch.long)  # 4 equal examples
    per = per_sample_grads(model, loss_fn, (x, y))
    assert not torch.allclose(per["0.weight"][0], per["0.weight"][1])
    # each example's gradient is one of a single-example loop's (a dropout mask scaled by 2)
    w = per["0.weight"]
    kept = (per["2.weight"] != 0).any(1)  # units whose dropout mask kept them, per example
    assert ((w.abs().sum(2) != 0) <= kept).all()
    model.eval()
    per = per_sample_grads(model, loss_fn, (x, y))
    torch.testing.assert_close(per["0.weight"][0], per["0.weight"][3])


def test_argument_errors():
    model, x, y = _problem("mlp")
    with pytest.raises(ValueError, match="either generator= or seed="):
        dp_sgd_grads(model, loss_fn, (x, y), max_norm=1.0, noise_multiplier=1.0, seed=1,
                     generator=torch.Generator())
    with pytest.raises(ValueError, match="reduction"):
        dp_sgd_grads(model, loss_fn, (x, y), max_norm=1.0, noise_multiplier=1.0, reduction="avg")
    with pytest.raises(ValueError, match="max_norm"):
        dp_sgd_grads(model, loss_fn, (x, y), max_norm=0.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="dim-0 size"):
        dp_sgd_grads(model, loss_fn, (x, y[:3]), max_norm=1.0, noise_multiplier=1.0)


def _gloo_available():
    import torch.distributed as dist
    return dist.is_available() and dist.is_gloo_available()


# the *_ghost modes: the same with dp_sgd_grads(..., method="ghost") (tests/models/test_dp_ghost.py)
MODES = ["allreduce", "ddp", "allreduce_ghost", "ddp_ghost"]


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    """Launch 2 gloo ranks once (every mode in one process group); {mode: [params per rank]}."""
    if not _gloo_available():
        pytest.skip("torch.distributed with gloo is unavailable")
    tmp = tmp_path_factory.mktemp("dp_ranks")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    init = f"file://{tmp / 'store'}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.models.dp_worker", str(r), "2", init,
                               ",".join(MODES), str(tmp)], cwd=root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=50)[0].decode(errors="replace"))
    finally:
        for p in procs:  # never leave a rank waiting on a dead peer
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r] if r < len(logs) else ''}"
    return {m: [torch.load(tmp / f"{m}_rank{r}.pt") for r in range(2)] for m in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_two_processes_equal_one_process(mode, two_process_results):
    """Each rank holds half the batch; after the same DP-SGD steps (clipped sums all-reduced,
    noise added once by rank 0; or DDP all-reducing a surrogate's gradients) both ranks hold
    the parameters of one process on the whole batch."""
    from tests.models.dp_worker import reference_params
    ref = reference_params()
    for rank, params in enumerate(two_process_results[mode]):
        _close(params, ref)
        # without communication a rank ends elsewhere (else this test would prove nothing)
        alone = reference_params(shard=rank)
        assert not torch.allclose(alone["0.weight"], ref["0.weight"], atol=1e-4)


EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples",
                       "dp_sgd_mnist_like.py")


@pytest.fixture(scope="module")
def example_output():
    """The DP-SGD example's stdout, run as a user runs it (with this checkout's functrans)."""
    root = os.path.abspath(os.path.join(os.path.dirname(EXAMPLE), os.pardir))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.run([sys.executable, EXAMPLE], capture_output=True, text=True,
                          timeout=120, check=True, env=env).stdout


def test_training_example_runs_and_learns(example_output):
    import re
    out = example_output
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) >= 3 and losses[-1] < 0.5 * losses[0], out
    sizes = [(int(a), int(b)) for a, b in re.findall(r"batch sizes (\d+)-(\d+)", out)]
    assert len(sizes) == 2 and all(lo < hi for lo, hi in sizes), out   # Poisson: sizes vary


def test_training_example_prints_the_epsilon_of_its_run(example_output):
    """The planned noise multiplier is noise_for_epsilon's, and the ε printed after each epoch
    is privacy_spent(...) of the steps taken so far, within the target."""
    pytest.importorskip("opacus")
    import importlib.util
    import re
    from functrans.nn.dp import noise_for_epsilon, privacy_spent
    spec = importlib.util.spec_from_file_location("dp_sgd_mnist_like", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)   # the constants (main() runs only as a script)
    out = example_output
    sigma = noise_for_epsilon(target_epsilon=ex.TARGET_EPSILON, sample_rate=ex.SAMPLE_RATE,
                              steps=ex.EPOCHS * ex.STEPS_PER_EPOCH, delta=ex.DELTA)
    planned = re.search(r"need noise multiplier (\d+\.\d+)", out)
    assert planned and float(planned.group(1)) == pytest.approx(sigma, abs=5e-7), out
    printed = re.findall(r"epoch (\d+) +(\d+) steps.*ε = (\d+\.\d+) \(δ = ([\d.e-]+), RDP\)",
                         out)
    assert [int(e) for e, _, _, _ in printed] == list(range(1, ex.EPOCHS + 1)), out
    for epoch, steps, eps, delta in printed:
        assert int(steps) == int(epoch) * ex.STEPS_PER_EPOCH and float(delta) == ex.DELTA
        expected = privacy_spent(noise_multiplier=sigma, sample_rate=ex.SAMPLE_RATE,
                                 steps=int(steps), delta=ex.DELTA)
        assert float(eps) == pytest.approx(expected, abs=5e-5), out
    assert ex.TARGET_EPSILON - 0.01 <= float(printed[-1][2]) <= ex.TARGET_EPSILON
