"""The public coverage API: record_fallbacks(), batching_coverage(), batching_rules(), and the
rules file that fallback messages name."""
import contextlib
import threading
import warnings

import pytest
import torch

import functrans
from functrans import vmap
from functrans.batching import registry
from tests.batching.test_fallback import scaled_cumsum  # registers the custom op

del scaled_cumsum  # (imported for its registration only)

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
    assert rules["aten.convolution.default"] == "functrans/batching/rules/conv.py"
    assert rules["aten.sin.default"] == "functrans/batching/rules/pointwise.py"
    assert rules["aten.permute_copy.default"] == "functrans/batching/rules/views.py"
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
    from functrans.batching import fallback
    f = torch.ops.functrans_test.front_only
    fallback._warned.discard(f.default)
    with pytest.warns(functrans.PerformanceWarning, match="rule for .*front_only.* does not handle"):
        vmap(f, in_dims=1)(torch.randn(4, 3))
    with functrans.config.strict_fallback(), pytest.raises(
            functrans.UnsupportedUnderVmap, match="front_only.default declined these arguments"):
        vmap(f, in_dims=1)(torch.randn(4, 3))


def test_deliberate_fallbacks_quote_their_reason():
    import torch.nn.functional as F
    from functrans.batching import fallback
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


# --- batching_rules() / the op listing do not depend on what ran earlier in the process -------

_LISTING_SCRIPT = r"""
import json, sys, torch, functrans as ft
from functrans.batching.op_schema import all_overloads
if sys.argv[1] == "after":
    # run transforms (loading the op packets they use), then load every aten packet
    ft.vmap(ft.grad(lambda x: (x ** 2).sum()))(torch.randn(2, 3))
    ft.jacrev(lambda v: v.sin())(torch.randn(3))
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::"):
            getattr(torch.ops.aten, name[len("aten::"):].partition(".")[0])
print(json.dumps({"overloads": sorted(map(str, all_overloads())),
                  "rules": ft.batching_rules()}))
"""


def test_op_schema_is_the_same_in_a_fresh_process_and_after_loading_ops():
    import json
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[2]
    procs = {when: subprocess.Popen([sys.executable, "-c", _LISTING_SCRIPT, when], cwd=root,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for when in ("fresh", "after")}
    got = {}
    for when, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        got[when] = json.loads(out.strip().splitlines()[-1])
    fresh, after = got["fresh"], got["after"]
    assert set(fresh["overloads"]) == set(after["overloads"]), (
        sorted(set(after["overloads"]) ^ set(fresh["overloads"]))[:20])
    assert fresh["rules"] == after["rules"]
    # complete: every overload the dispatcher registers, e.g. one whose packet nothing loads
    assert "aten.mkldnn_rnn_layer.default" in fresh["overloads"]
    assert len(fresh["overloads"]) == len({n for n in torch._C._dispatch_get_all_op_names()
                                           if n.startswith("aten::")})


def test_op_schema_has_only_dispatcher_ops_and_every_caller_works():
    from functrans.batching.op_schema import all_overloads
    ovs = all_overloads()
    assert all(isinstance(ov, torch._ops.OpOverload) and ov.namespace == "aten" for ov in ovs)
    assert aten.add.Tensor in ovs and aten.sum.default in ovs
    names = set(map(str, ovs))
    assert "aten.mul.left_t" not in names  # TorchScript-only: never reaches __torch_dispatch__
    assert all_overloads() == ovs           # cached, same answer
    rules = functrans.batching_rules()
    assert set(rules) <= names and len(rules) > 1300


# --- a user's own rule points messages at the user's code, not at a functrans file -------------

@torch.library.custom_op("functrans_test::softclip", mutates_args=())
def softclip(x: torch.Tensor, limit: float) -> torch.Tensor:
    return x.clamp(-limit, limit)


@softclip.register_fake
def _(x, limit):
    return torch.empty_like(x)


# registered as a user's script would be (module __main__), and the rule declines everything
exec("from functrans.extend import register_batch_rule, Decline\n"
     "@register_batch_rule(torch.ops.functrans_test.softclip.default)\n"
     "def _softclip_rule(info, in_dims, x, limit):\n"
     "    raise Decline()\n",
     {"__name__": "__main__", "torch": torch})


def test_a_users_declining_rule_points_at_the_users_own_code():
    from functrans.batching import fallback
    op = torch.ops.functrans_test.softclip.default
    assert registry.family_of(op) == "custom"
    fallback._warned.discard(op)
    with pytest.warns(functrans.PerformanceWarning, match="belongs in your own code") as caught, \
            functrans.record_fallbacks() as report:
        vmap(lambda x: softclip(x, 2.0))(torch.randn(4, 3))
    rec = report.ops[str(op)]
    assert rec.rules_file.startswith("your own code") and "rules/" not in rec.rules_file
    assert "your own code" in str(report) and "__main__" not in str(report)
    assert not any("functrans/batching/rules" in str(w.message) for w in caught)
    # a rule registered from any other module outside functrans.batching.rules, too
    assert registry.family_of(torch.ops.functrans_test.front_only.default) == "custom"
    assert registry.rules_file(torch.ops.functrans_test.front_only.default).startswith(
        "your own code")


@torch.library.custom_op("functrans_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


registry.register_batch_rule(torch.ops.functrans_test.twice.default,
                             lambda info, in_dims, x: (x * 2, in_dims[0]), family="mylib")


def test_an_explicit_family_outside_functrans_is_the_users_own_code():
    assert registry.rules_file(torch.ops.functrans_test.twice.default).startswith("your own code")
    # functrans's own families are unchanged
    assert registry.rules_file(aten.convolution.default) == "functrans/batching/rules/conv.py"
    assert registry.family_of(aten.sin.default) == "pointwise"


def test_adaptive_max_pool3d_forward_is_batched_and_not_listed_as_a_fallback():
    import torch.nn.functional as F
    from functrans.batching.known_fallbacks import reason
    assert reason(aten.adaptive_max_pool3d.default) == ""
    assert reason(aten.adaptive_max_pool3d_backward.default)  # the backward still loops
    x = torch.randn(3, 2, 4, 4, 4)
    with functrans.config.strict_fallback():
        got = vmap(lambda a: F.adaptive_max_pool3d(a, 2))(x)
    torch.testing.assert_close(got, torch.stack([F.adaptive_max_pool3d(a, 2) for a in x]))
