"""functrans on real models (HF transformers and timm, tiny configs, nothing downloaded;
``zoo.py`` builds them) against plain eager PyTorch one example (or one model) at a time:

* per-sample gradients: ``vmap(grad(loss))`` over ``functional_call``, eval mode (dropout off;
  the replaced-BatchNorm ResNet in training mode, each example normalised by its own statistics);
* ensembles: ``stack_module_state`` of two models + ``vmap`` (timm's ConvNeXt included: its
  head pools a channels_last input, which ATen restrides with ``as_strided_``);
* ``jvp`` (one example, and under ``vmap``) and ``vmap(vjp)`` of the logits w.r.t. the input embeddings (text) or the pixels;
* the per-sample gradients through ``functrans.compile``;
* ``jacfwd`` and ``hessian`` through attention (the fused CPU kernel has no forward formula:
  functrans runs its math composition in forward mode, ``functrans/autodiff/math_attention.py``);
* padded batches: a padding mask per example (``attention_mask``); HF's Python control flow on
  the mask (``torch.all(mask == 1)``) runs once when every example agrees, and is refused with
  a clear error when they disagree (torch.func refuses both);
* dropout in training mode, deliberately: ``randomness='same'`` equals the loop re-seeded per
  example, ``'different'`` gives identical examples different gradients, ``'error'`` refuses.

Every functrans call runs under ``strict_fallback()`` inside ``record_fallbacks()``: no op of
these models reaches the per-example loop fallback.

The tests skip, with the reason, when transformers or timm is missing (``pip install
functrans[models]``, or ``bash scripts/setup.sh dev``).
"""
import contextlib
import re

import pytest
import torch

import functrans as ft
from tests.models.real import zoo
from tests.support.oracles import assert_same

TOL = dict(rtol=1e-4, atol=1e-5)
ATTENTION = ["gpt2", "bert", "distilbert", "llama", "t5", "bart", "hf_vit", "timm_vit"]
# Tracing a whole model for functrans.compile costs 1-4 s a model on one core: the default run
# compiles two (a transformer, a CNN with GroupNorm); the others run with -m sweep.
COMPILED_BY_DEFAULT = ["gpt2", "timm_resnet_gn"]
# Compiled functions with a graph break, where functrans.compile says it is: BART's decoder asks
# HF's `_ignore_causal_mask_sdpa` whether its padding mask is all ones (`fast_all(mask)`, a
# bool() of a tensor; HF skips the check only under its own list of tracers: torch.jit, fx
# proxies, dynamo).  The graph ends a segment there and guards the value read (True), so the
# rest stays compiled (compiler/breaks.py); before graph breaks, BART's step ran eagerly.
BREAKS = {"bart": r"masking_utils.py:\d+ \(in _ignore_causal_mask_sdpa\)"}


def _spec(name):
    try:
        return zoo.spec(name)
    except ImportError as e:
        pytest.skip(str(e))


@contextlib.contextmanager
def no_fallback():
    """Strict (a fallback raises) and recorded (the report must stay empty)."""
    with ft.record_fallbacks() as report, ft.config.strict_fallback():
        yield report
    assert not report, str(report)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_per_sample_grads(name):
    spec = _spec(name)
    model = spec.make(0)
    xs, ys = spec.batch()
    with no_fallback():
        got = zoo.per_sample_grads(ft, spec, model, xs, ys)
    assert_same(got, zoo.loop_per_sample_grads(spec, model, xs, ys), **TOL, msg=name)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_ensemble(name):
    spec = _spec(name)
    models = [spec.make(0), spec.make(1)]
    xs, _ = spec.batch()
    with no_fallback():
        got = zoo.ensemble(ft, spec, models, xs)
    expected = zoo.loop_ensemble(spec, models, xs)
    assert not torch.allclose(expected[0], expected[1])   # two different models
    assert_same(got, expected, **TOL, msg=name)


def test_convnext_ensemble_pools_a_channels_last_input():
    """Issue 25: timm's ConvNeXt head runs ``adaptive_avg_pool2d(x, 1)`` on a channels_last
    input, which ATen restrides in place (``as_strided_``); under vmap that is a no-op on the
    batched mean (fixed on main); here the model's own head, in an ensemble."""
    spec = _spec("timm_convnext")
    models = [spec.make(0), spec.make(1)]
    xs, _ = spec.batch()
    seen = []
    hook = models[0].head.global_pool.register_forward_pre_hook(
        lambda mod, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)
                                      and args[0].shape[-1] > 1))
    try:
        expected = zoo.loop_ensemble(spec, models[:1], xs)
    finally:
        hook.remove()
    assert seen and all(seen)   # the eager head pools a channels_last map larger than 1x1
    with no_fallback():
        got = zoo.ensemble(ft, spec, models, xs)
    assert_same(got[:1], expected, **TOL)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_jvp_of_logits_wrt_inputs(name):
    spec = _spec(name)
    model = spec.make(0)
    xs, _ = spec.batch()
    es, ts, _ = zoo.embeds_and_directions(spec, model, xs)
    with no_fallback():
        got = zoo.jvp_embeds(ft, spec, model, es, ts)
    expected = zoo.loop_jvp_embeds(spec, model, es, ts)
    assert_same(got, expected, **TOL, msg=name)
    one = ft.jvp(lambda e: spec.from_embeds(model, e), (es[0],), (ts[0],))   # outside vmap
    assert_same(one, (expected[0][0], expected[1][0]), **TOL, msg=name)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_vmap_of_vjp_of_logits_wrt_inputs(name):
    spec = _spec(name)
    model = spec.make(0)
    xs, _ = spec.batch()
    es, _, cts = zoo.embeds_and_directions(spec, model, xs)
    with no_fallback():
        got = zoo.vjp_embeds(ft, spec, model, es, cts)
    assert_same(got, zoo.loop_vjp_embeds(spec, model, es, cts), **TOL, msg=name)


@pytest.mark.parametrize("name", [
    n if n in COMPILED_BY_DEFAULT else pytest.param(n, marks=pytest.mark.sweep)
    for n in zoo.MODELS])
def test_compiled_per_sample_grads(name):
    spec = _spec(name)
    model = spec.make(0)
    xs, ys = spec.batch()
    step = ft.compile(lambda p, x, y: zoo.per_sample_grads(ft, spec, model, x, y))
    params, _ = zoo.params_and_buffers(model)
    expected = zoo.loop_per_sample_grads(spec, model, xs, ys)
    with no_fallback():
        first = step(params, xs, ys)
    xs2, ys2 = xs.flip(0), ys.flip(0)          # other values, same shapes: the traced graph
    second = step(params, xs2, ys2)
    info = step.cache_info()
    assert info.hits >= 1 and not info.eager_calls, info
    breaks = [b for e in info.entries for b in e.breaks]
    if name in BREAKS:
        assert [e.segments for e in info.entries] == [2], info
        assert re.search(BREAKS[name], breaks[0]) and breaks[0].endswith("read True"), info
    else:
        assert not breaks, info
    assert_same(first, expected, **TOL, msg=name)
    assert_same(second, zoo.loop_per_sample_grads(spec, model, xs2, ys2), **TOL, msg=name)


@pytest.mark.sweep
def test_inductor_compiles_t5_per_sample_grads():
    """Inductor propagates its own strides through the traced graph: T5's per-sample gradients
    have a ``view`` that the eager strides allowed and Inductor's did not ("Cannot view a
    tensor with shape [3, 2, 8, 5] and strides (80, 8, 1, 16)"), so the graph stayed on
    replay; the inductor backend now gives it ``reshape`` (compiler/backends/inductor.py).
    About a minute of Inductor on one core."""
    spec = _spec("t5")
    model = spec.make(0)
    xs, ys = spec.batch()
    step = ft.compile(lambda p, x, y: zoo.per_sample_grads(ft, spec, model, x, y),
                      backend="inductor")
    params, _ = zoo.params_and_buffers(model)
    got = step(params, xs, ys)
    info = step.cache_info()
    assert [e.backend for e in info.entries] == ["inductor"], info
    assert_same(got, zoo.loop_per_sample_grads(spec, model, xs, ys), **TOL, msg="t5")


@pytest.mark.parametrize("name", ATTENTION)
def test_jacfwd_and_hessian_through_attention(name):
    """Forward mode through F.scaled_dot_product_attention: jacfwd of the logits against plain
    reverse mode row by row, hessian-vector products against plain double backward (attention on
    its math kernel there: the fused kernel's backward has no derivative in PyTorch)."""
    spec = _spec(name)
    model = spec.make(0)
    xs, _ = spec.batch()
    e = zoo.embeds_and_directions(spec, model, xs)[0][0]
    with no_fallback():
        jf = zoo.jacfwd_logits(ft, spec, model, e)
        h = zoo.hessian_energy(ft, spec, model, e)
    assert_same(jf, zoo.loop_jacobian_logits(spec, model, e), **TOL, msg=name)
    n = e.numel()
    vs = torch.randn(3, *e.shape, generator=torch.Generator().manual_seed(3))
    hv = (h.reshape(n, n) @ vs.reshape(3, n).T).T.reshape(vs.shape)
    assert_same(hv, zoo.loop_hessian_energy(spec, model, e, vs), rtol=1e-3, atol=1e-4,
                msg=name)
    torch.testing.assert_close(h.reshape(n, n), h.reshape(n, n).T, rtol=1e-3, atol=1e-4)


TEXT = [n for n in zoo.TRANSFORMERS if n != "hf_vit"]


@pytest.mark.parametrize("name", TEXT)
def test_per_sample_grads_of_a_padded_batch(name):
    spec = _spec(name)
    model = spec.make(0)
    xs, ys = spec.batch()
    masks = torch.ones_like(xs)
    masks[0, -2:] = 0
    masks[1:, -1] = 0           # every example padded: the models' checks agree
    with no_fallback():
        got = zoo.per_sample_grads(ft, spec, model, xs, ys, masks=masks)
    assert_same(got, zoo.loop_per_sample_grads(spec, model, xs, ys, masks), **TOL, msg=name)
    masks[1] = 1                # one example unpadded: `if torch.all(mask == 1)` disagrees
    with pytest.raises(ft.UnsupportedUnderVmap, match="bool"):
        zoo.per_sample_grads(ft, spec, model, xs, ys, masks=masks)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_dropout_randomness_in_training_mode(name):
    spec = _spec(name)
    model = spec.make(0).train()
    xs, ys = spec.batch()
    # 'same': one dropout draw shared by the batch, as each example's eager draw after the
    # same seed
    torch.manual_seed(5)
    with no_fallback():
        same = zoo.per_sample_grads(ft, spec, model, xs, ys, {"randomness": "same"})
    loop = []
    for i in range(len(xs)):
        torch.manual_seed(5)
        loop.append(zoo.loop_per_sample_grads(spec, model, xs[i:i + 1], ys[i:i + 1]))
    assert_same(same, {k: torch.cat([g[k] for g in loop]) for k in same}, **TOL)
    # 'different': identical examples get different dropout draws, so different gradients
    x1, y1 = xs[:1].expand_as(xs).contiguous(), ys[:1].expand_as(ys).contiguous()
    with no_fallback():
        diff = zoo.per_sample_grads(ft, spec, model, x1, y1, {"randomness": "different"})
        shared = zoo.per_sample_grads(ft, spec, model, x1, y1, {"randomness": "same"})
    w = next(k for k in diff if diff[k].dim() > 2)
    assert not torch.allclose(diff[w][0], diff[w][1])
    torch.testing.assert_close(shared[w][0], shared[w][1])
    with pytest.raises(ft.UnsupportedUnderVmap, match="random"):
        zoo.per_sample_grads(ft, spec, model, xs, ys)        # randomness='error' (default)
