"""The compiled DP-SGD step (functrans.nn.dp.compiled_private_step): Poisson-sampled batches of
changing size padded to bucket sizes with masked rows, one trace per bucket.

References: the eager path of the same module on the UNPADDED batch (``clip_and_sum`` of
``per_sample_grads``, ``dp_sgd_grads`` with the same generator), itself tested against a
per-example autograd loop in tests/models/test_dpsgd.py.

On exactness: a padded row's gradient is replaced by exact zeros before the norms and the sum.
Where the summation order is the same (same padded shape, same graph) the results are compared
bitwise (``torch.equal``); the padded sum against the unpadded eager sum runs a contraction
over a longer dimension, whose order BLAS may block differently, so it is compared to a tight
tolerance (on this machine it happens to be bitwise equal too).
"""
import pytest
import torch
from torch import nn

from functrans.nn.dp import (clip_and_sum, compiled_private_step, dp_sgd_grads,
                             per_sample_grads)

N_DATA = 40


def _mlp():
    return nn.Sequential(nn.Linear(7, 10), nn.Tanh(), nn.Linear(10, 4))


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N_DATA, 7, generator=g), torch.randint(0, 4, (N_DATA,), generator=g)


def _poisson_batches(x, y, steps, rate, seed):
    """Each example joins each step's batch independently with probability ``rate``."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        keep = torch.rand(x.shape[0], generator=g) < rate
        yield x[keep], y[keep]


def _close(a, b, atol=1e-6, rtol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=k)


@pytest.mark.parametrize("buckets,max_batch_size", [(None, N_DATA), (6, N_DATA),
                                                    ([4, 8, 12, 20, 30, N_DATA], None)])
def test_clipped_sum_equals_eager_unpadded_over_poisson_steps(buckets, max_batch_size):
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data()
    step = compiled_private_step(model, loss_fn, max_norm=2.0, noise_multiplier=0.0,
                                 buckets=buckets, max_batch_size=max_batch_size)
    sizes, used = [], set()
    for bx, by in _poisson_batches(x, y, steps=20, rate=0.35, seed=1):
        n = bx.shape[0]
        sizes.append(n)
        if n:
            used.add(step.bucket_for(n))
        got, norms = step((bx, by), return_norms=True)
        want, want_norms = clip_and_sum(per_sample_grads(model, loss_fn, (bx, by)), 2.0)
        _close(got, want)
        torch.testing.assert_close(norms, want_norms, atol=1e-6, rtol=1e-5)
    assert len(set(sizes)) >= 6, sizes          # the sizes really changed from step to step
    info = step.cache_info()
    assert info.misses <= len(used), (info, used, sizes)
    assert info.eager_calls == 0 and info.eager_reason is None   # really replayed, never eager
    assert info.hits == sum(1 for n in sizes if n) - info.misses
    assert len(used) < len(set(sizes))         # fewer traces than distinct sizes


def test_some_examples_are_clipped_and_some_not():
    """The tolerance test above exercises both branches of the clipping factor."""
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data()
    step = compiled_private_step(model, loss_fn, max_norm=2.0, noise_multiplier=0.0)
    _, norms = step((x[:13], y[:13]), return_norms=True)
    assert (norms > 2.0).any() and (norms < 2.0).any()


def test_padded_rows_contribute_exactly_zero():
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data()
    n, size = 5, 8
    step = compiled_private_step(model, loss_fn, max_norm=2.0, noise_multiplier=0.0,
                                 buckets=[size])
    mask = torch.arange(size) < n

    def padded(fill_x, fill_y):
        return (torch.cat([x[:n], fill_x.expand(size - n, 7)]),
                torch.cat([y[:n], torch.full((size - n,), fill_y)]))

    # 1. Same graph, same summation order, different padding content (including rows whose
    #    gradient is NaN / infinite): bitwise equal, so the padded rows contribute nothing.
    a_sums, a_norms = step.masked_clipped_sum(padded(torch.zeros(7), 0), mask)
    b_sums, b_norms = step.masked_clipped_sum(padded(torch.full((7,), float("nan")), 3), mask)
    c_sums, c_norms = step.masked_clipped_sum(padded(torch.full((7,), float("inf")), 1), mask)
    for k in a_sums:
        assert torch.equal(a_sums[k], b_sums[k]) and torch.equal(a_sums[k], c_sums[k]), k
    assert torch.equal(a_norms, b_norms) and torch.equal(a_norms, c_norms)
    assert torch.equal(a_norms[n:], torch.zeros(size - n))

    # 2. The eager recipe on the same padded shape with the padded rows' gradients set to 0.0
    #    by hand: the same summation order, bitwise equal.
    ps = per_sample_grads(model, loss_fn, padded(torch.zeros(7), 0))
    for g in ps.values():
        g[n:] = 0.0
    e_sums, e_norms = clip_and_sum(ps, 2.0)
    for k in a_sums:
        assert torch.equal(a_sums[k], e_sums[k]), k
    assert torch.equal(a_norms, e_norms)

    # 3. Against the unpadded eager sum (a shorter contraction): tight tolerance.
    u_sums, u_norms = clip_and_sum(per_sample_grads(model, loss_fn, (x[:n], y[:n])), 2.0)
    _close(a_sums, u_sums, atol=1e-7, rtol=1e-6)
    assert torch.equal(a_norms[:n], u_norms)   # per-row norms: no cross-row summation
    assert step.cache_info().misses == 1       # one shape, one trace


def test_noise_from_a_seed_matches_eager_with_the_same_generator():
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data()
    step = compiled_private_step(model, loss_fn, max_norm=0.5, noise_multiplier=1.3, seed=7)
    gen = torch.Generator().manual_seed(7)     # the eager side's generator, advanced per step
    previous = None
    for bx, by in _poisson_batches(x, y, steps=6, rate=0.3, seed=2):
        got = step((bx, by))
        want = dp_sgd_grads(model, loss_fn, (bx, by), max_norm=0.5, noise_multiplier=1.3,
                            generator=gen)
        _close(got, want)
        clean = clip_and_sum(per_sample_grads(model, loss_fn, (bx, by)), 0.5)[0] \
            if bx.shape[0] else {k: torch.zeros_like(v) for k, v in got.items()}
        noise = {k: got[k] - clean[k] for k in got}
        assert all(v.std() > 0.3 for v in noise.values())     # noise of std 0.65 was added
        if previous is not None:                                 # fresh noise every step
            assert not torch.allclose(noise["0.weight"], previous)
        previous = noise["0.weight"]


def test_explicit_generator_is_advanced_like_the_eager_path():
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data()
    g_compiled, g_eager = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    step = compiled_private_step(model, loss_fn, max_norm=0.5, noise_multiplier=0.8,
                                 generator=g_compiled, reduction="mean")
    for n in (9, 3, 14):
        got = step((x[:n], y[:n]))
        want = dp_sgd_grads(model, loss_fn, (x[:n], y[:n]), max_norm=0.5, noise_multiplier=0.8,
                            generator=g_eager, reduction="mean")
        _close(got, want)
    assert torch.equal(g_compiled.get_state(), g_eager.get_state())


def test_empty_batch_is_handled_as_the_eager_path_handles_it():
    torch.manual_seed(0)
    model = _mlp()
    x, y = _data()
    step = compiled_private_step(model, loss_fn, max_norm=0.5, noise_multiplier=1.0, seed=4)
    got, norms = step((x[:0], y[:0]), return_norms=True)
    want, want_norms = dp_sgd_grads(model, loss_fn, (x[:0], y[:0]), max_norm=0.5,
                                    noise_multiplier=1.0, seed=4, return_norms=True)
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), k       # the same path: zero sum + the noise
        assert got[k].shape == dict(model.named_parameters())[k].shape
    assert norms.shape == want_norms.shape == (0,)
    clean = compiled_private_step(model, loss_fn, max_norm=0.5, noise_multiplier=0.0)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in clean((x[:0], y[:0])).values())
    assert step.cache_info().misses == 0               # nothing traced for an empty batch
    mean = compiled_private_step(model, loss_fn, max_norm=0.5, noise_multiplier=1.0,
                                 reduction="mean")
    with pytest.raises(ValueError, match="empty"):
        mean((x[:0], y[:0]))
    with pytest.raises(ValueError, match="empty"):
        dp_sgd_grads(model, loss_fn, (x[:0], y[:0]), max_norm=0.5, noise_multiplier=1.0,
                     reduction="mean")


def test_bucket_sizes_and_batches_above_the_maximum():
    model = _mlp()
    x, y = _data()
    default = compiled_private_step(model, loss_fn, max_norm=1.0, noise_multiplier=0.0,
                                    max_batch_size=26)
    # four sizes per octave (3 leading binary digits), never above max_batch_size
    assert [default.bucket_for(n) for n in range(1, 27)] == \
        [1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 12, 12, 14, 14, 16, 16, 20, 20, 20, 20, 24, 24, 24, 24,
         26, 26]
    with pytest.raises(ValueError, match="max_batch_size=26"):
        default((x[:27], y[:27]))
    multiples = compiled_private_step(model, loss_fn, max_norm=1.0, noise_multiplier=0.0,
                                      buckets=5, max_batch_size=12)
    assert [multiples.bucket_for(n) for n in (1, 5, 6, 11, 12)] == [5, 5, 10, 12, 12]
    listed = compiled_private_step(model, loss_fn, max_norm=1.0, noise_multiplier=0.0,
                                   buckets=[8, 4])
    assert [listed.bucket_for(n) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    with pytest.raises(ValueError, match=r"buckets=\[4, 8\]"):
        listed((x[:9], y[:9]))
    assert listed.cache_info().misses == 0          # the error comes before any trace
    unbounded = compiled_private_step(model, loss_fn, max_norm=1.0, noise_multiplier=0.0)
    assert [unbounded.bucket_for(n) for n in (33, 41, 100, 129, 1000)] == \
        [40, 48, 112, 160, 1024]                       # no maximum: the buckets grow
    got = unbounded((x[:33], y[:33]))
    _close(got, clip_and_sum(per_sample_grads(model, loss_fn, (x[:33], y[:33])), 1.0)[0])
    powers = compiled_private_step(model, loss_fn, max_norm=1.0, noise_multiplier=0.0,
                                   buckets=[1, 2, 4, 8, 16, 32, 64])
    assert [powers.bucket_for(n) for n in (3, 17, 33)] == [4, 32, 64]


@pytest.mark.parametrize("kwargs,match", [
    (dict(buckets=0), "buckets"), (dict(buckets=[]), "buckets"),
    (dict(buckets=[4, 0]), "bucket size"), (dict(max_batch_size=0), "max_batch_size"),
    (dict(buckets=[4, 8], max_batch_size=8), "max_batch_size"),
    (dict(max_norm=0.0), "max_norm"), (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(reduction="avg"), "reduction"), (dict(seed=1, generator=torch.Generator()), "seed"),
    (dict(backend="nope"), "backend")])
def test_argument_errors(kwargs, match):
    args = dict(max_norm=1.0, noise_multiplier=0.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        compiled_private_step(_mlp(), loss_fn, **args)


def test_mask_argument_is_checked():
    x, y = _data()
    step = compiled_private_step(_mlp(), loss_fn, max_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(ValueError, match="mask"):
        step.masked_clipped_sum((x[:4], y[:4]), torch.ones(4))           # not bool
    with pytest.raises(ValueError, match="mask"):
        step.masked_clipped_sum((x[:4], y[:4]), torch.ones(3, dtype=torch.bool))


def test_dropout_model_compiles_once_per_bucket():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 10), nn.Dropout(0.3), nn.Linear(10, 4))
    x, y = _data()
    step = compiled_private_step(model, loss_fn, max_norm=0.5, noise_multiplier=0.0,
                                 max_batch_size=N_DATA)
    used = set()
    for bx, by in _poisson_batches(x, y, steps=8, rate=0.3, seed=5):
        if bx.shape[0]:
            used.add(step.bucket_for(bx.shape[0]))
        out, norms = step((bx, by), return_norms=True)
        assert all(torch.isfinite(v).all() for v in out.values())
        assert (norms <= 10).all()
    info = step.cache_info()
    assert info.misses <= len(used) and info.eager_calls == 0
    # the masks are drawn: two calls on the same batch differ (fresh dropout each call)
    a, b = step((x[:8], y[:8])), step((x[:8], y[:8]))
    assert not torch.equal(a["0.weight"], b["0.weight"])


def test_training_compiled_and_eager_from_the_same_seed_end_equal():
    def train(compiled):
        torch.manual_seed(0)
        model = _mlp()
        x, y = _data()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        noise = torch.Generator().manual_seed(11)
        step = compiled_private_step(model, loss_fn, max_norm=1.0, noise_multiplier=0.5,
                                     generator=noise, buckets=8, max_batch_size=N_DATA)
        for bx, by in _poisson_batches(x, y, steps=6, rate=0.3, seed=9):
            if compiled:
                grads = step((bx, by))
            else:
                grads = dp_sgd_grads(model, loss_fn, (bx, by), max_norm=1.0,
                                     noise_multiplier=0.5, generator=noise)
            for name, p in model.named_parameters():
                p.grad = grads[name] / 12.0       # the expected batch size, 0.3 * 40
            opt.step()
        return dict(model.named_parameters()), step

    eager_params, _ = train(compiled=False)
    compiled_params, step = train(compiled=True)
    _close({k: v.detach() for k, v in compiled_params.items()},
           {k: v.detach() for k, v in eager_params.items()}, atol=1e-5, rtol=1e-5)
    assert step.cache_info().misses <= 5           # buckets of 8 up to 40
    assert step.cache_info().hits >= 1
    torch.manual_seed(0)
    start = dict(_mlp().named_parameters())          # the same initial parameters
    assert all((compiled_params[k] - start[k]).abs().max() > 1e-3 for k in start)  # it trained
