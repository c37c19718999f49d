"""The public coverage API: record_fallbacks(), batching_coverage(), batching_rules(), and the
rules file that fallback messages name."""
import contextlib
import threading
import warnings

import pytest
import torch

import functrans
from functrans import vmap
from functrans.vmap import registry
from tests.vmap.test_fallback import scaled_cumsum  # noqa: F401  (registers the custom op)

aten = torch.ops.aten


def _custom(a):
    return torch.ops.functrans_test.scaled_cumsum(a, 2.0)


def test_record_fallbacks_counts_calls_and_time_per_op():
    x = torch.randn(4, 5)
    with _quiet():
        with functrans.record_fallbacks() as report:
            vmap(_custom)(x)
            vmap(lambda a: _custom(a).sin())(x)  # sin has a rule: not recorded
            vmap(_custom, chunk_size=2)(x)       # two chunks: two more calls
    assert list(report.ops) == ["functrans_test.scaled_cumsum.default"]
    rec = report.ops["functrans_test.scaled_cumsum.default"]
    assert rec.calls == 4 and report.total_calls == 4
    assert rec.seconds > 0 and report.total_seconds == pytest.approx(rec.seconds)
    assert "your own code" in rec.rules_file
    text = str(report)
    assert "scaled_cumsum" in text and "4" in text and "1 op(s)" in text


def test_record_fallbacks_is_empty_when_rules_cover_everything():
    with functrans.record_fallbacks() as report:
        vmap(lambda a: (a.sin() @ a.T).softmax(-1))(torch.randn(3, 4, 4))
    assert not report and len(report) == 0 and "no op ran" in str(report)


def test_record_fallbacks_nests_and_ignores_other_threads():
    x = torch.randn(3, 2)
    with _quiet(), functrans.record_fallbacks() as outer:
        with functrans.record_fallbacks() as inner:
            vmap(_custom)(x)
        t = threading.Thread(target=lambda: vmap(_custom)(x))
        t.start()
        t.join()
        vmap(_custom)(x)
    assert inner.total_calls == 1
    assert outer.total_calls == 2  # the other thread's call is not this block's


@torch.library.custom_op("functrans_test::front_only", mutates_args=())
def front_only(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(0)


@registry.register_batch_rule(torch.ops.functrans_test.front_only.default)
def _front_only_rule(info, in_dims, x):
    if in_dims[0] != 0:
        raise registry.Decline()
    return x.cumsum(1), 0


def test_record_fallbacks_counts_declined_rules_only():
    x = torch.randn(3, 4)
    f = torch.ops.functrans_test.front_only
    with _quiet(), functrans.record_fallbacks() as report:
        by_rule = vmap(f)(x)
        declined = vmap(f, in_dims=1)(x.T.contiguous())
    torch.testing.assert_close(by_rule, x.cumsum(1))
    torch.testing.assert_close(declined, x.cumsum(1))
    assert report.total_calls == 1 and list(report.ops) == ["functrans_test.front_only.default"]


@pytest.mark.parametrize("op, how", [
    (aten.convolution.default, "rule"),
    (aten.sin.default, "tag"),
    (aten.permute_copy.default, "derived"),
    (aten.abs_.default, "derived"),
    (aten.add.out, "derived"),
    ("aten::linear", "composite"),
    ("functrans_test::scaled_cumsum", "fallback"),
])
def test_batching_coverage(op, how):
    assert functrans.batching_coverage(op) == how


def test_batching_coverage_takes_the_names_batching_rules_prints():
    for name, how in (("aten.convolution.default", "rule"), ("aten::index_add", "rule"),
                      ("sin.default", "tag"), ("aten.permute_copy.default", "derived")):
        assert functrans.batching_coverage(name) == how, name
    assert all(functrans.batching_coverage(n) in ("rule", "tag", "derived")
               for n in list(functrans.batching_rules())[:50])
    with pytest.raises(TypeError, match="op name like"):
        functrans.batching_coverage("aten.no_such_op.default")


def test_batching_coverage_rejects_non_ops():
    with pytest.raises(TypeError, match="expected an OpOverload"):
        functrans.batching_coverage(3)


def test_batching_rules_lists_rules_with_their_files():
    rules = functrans.batching_rules()
    assert rules["aten.convolution.default"] == "functrans/vmap/rules/conv.py"
    assert rules["aten.sin.default"] == "functrans/vmap/rules/pointwise.py"
    assert rules["aten.permute_copy.default"] == "functrans/vmap/rules/views.py"
    assert "aten.linear.default" not in rules  # composite: decomposes before vmap sees it
    assert len(rules) > 500


def test_rules_file_for_ops_without_rules_is_a_family_file():
    assert registry.rules_file(aten.mkldnn_rnn_layer.default).endswith("rules/rnn.py")
    assert registry.rules_file(aten.upsample_bicubic2d.default).endswith("rules/upsample.py")
    assert registry.rules_file(aten.histc.default).endswith("rules/histograms.py")
    assert "your own code" in registry.rules_file(torch.ops.functrans_test.scaled_cumsum.default)


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", functrans.PerformanceWarning)
        yield


def test_declined_rule_says_so_in_warning_and_strict_error():
    from functrans.vmap import fallback
    f = torch.ops.functrans_test.front_only
    fallback._warned.discard(f.default)
    with pytest.warns(functrans.PerformanceWarning, match="rule for .*front_only.* does not handle"):
        vmap(f, in_dims=1)(torch.randn(4, 3))
    with functrans.config.strict_fallback(), pytest.raises(
            functrans.UnsupportedUnderVmap, match="front_only.default declined these arguments"):
        vmap(f, in_dims=1)(torch.randn(4, 3))


def test_deliberate_fallbacks_quote_their_reason():
    import torch.nn.functional as F
    from functrans.vmap import fallback
    op = aten.adaptive_max_pool3d_backward.default
    fallback._warned.discard(op)
    x = torch.randn(3, 2, 4, 4, 4)
    loss = lambda a: F.adaptive_max_pool3d(a, 2).sum()  # noqa: E731
    f = functrans.grad(loss)
    with pytest.warns(functrans.PerformanceWarning, match="no batching rule on purpose: .*segf"):
        with functrans.record_fallbacks() as report:
            got = vmap(f)(x)
    rec = report.ops[str(op)]
    assert rec.calls == 1 and "segfault" in rec.on_purpose and "none on purpose" in str(report)
    torch.testing.assert_close(got, torch.func.vmap(torch.func.grad(loss))(x))
