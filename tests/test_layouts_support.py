"""tests/support/layouts.py: each layout keeps the batch's values (but ``expanded``) and gives
the examples the strides it names; a layout that changes nothing is None."""
import torch

from tests.support import layouts


def _batch(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def test_bdim_positions_of_plain_and_nested_batches():
    assert layouts.bdim_positions(3, [0]) == [0]
    assert layouts.bdim_positions(3, [-1]) == [3]
    assert layouts.bdim_positions(3, [0, 0]) == [1, 0]
    assert layouts.bdim_positions(3, [-1, -1]) == [3, 4]


def test_permuting_layouts_keep_values_and_lay_the_examples_out():
    b = _batch(3, 2, 4, 5, 6)                          # batch first, 4-d examples
    moved = layouts.lay_out(b, [0], "batch_moved")
    assert torch.equal(moved, b) and moved.stride(0) == 1
    tr = layouts.lay_out(b, [0], "transposed")
    assert torch.equal(tr, b) and tr[0].mT.is_contiguous()
    cl = layouts.lay_out(b, [0], "channels_last")
    assert torch.equal(cl, b) and cl[1].is_contiguous(memory_format=torch.channels_last)
    last = layouts.lay_out(b.movedim(0, -1).contiguous(), [4], "channels_last")
    ex = last.select(4, 0)          # the batch innermost, then C, W, H, N outwards
    assert last.stride(4) == 1 and ex.stride(1) < ex.stride(3) < ex.stride(2) < ex.stride(0)


def test_expanded_repeats_one_slice_and_respects_writes_and_dtypes():
    b = _batch(3, 4, 5)
    e = layouts.lay_out(b, [0], "expanded")
    assert e.stride(1) == 0 and torch.equal(e[:, 0], b[:, 0]) and torch.equal(e[:, 3], b[:, 0])
    assert layouts.lay_out(b, [0], "expanded", expandable=False) is None
    assert layouts.lay_out(torch.ones(3, 4, dtype=torch.long), [0], "expanded") is None


def test_a_layout_that_changes_nothing_is_none():
    assert layouts.lay_out(_batch(3, 5), [0], "transposed") is None
    assert layouts.lay_out(_batch(3, 2, 4, 5), [0], "channels_last") is None
    assert layouts.lay_out(_batch(3, 1, 1), [0], "batch_moved") is None
    assert layouts.lay_out(_batch(3, 4, 1), [0], "transposed") is None


def test_written_inputs_sees_version_counters_and_values():
    def bn(x, rm):
        return torch.nn.functional.batch_norm(x, rm, torch.ones(2), training=True)
    assert layouts.written_inputs(bn, [torch.randn(4, 2), torch.zeros(2)]) == frozenset({1})
    assert layouts.written_inputs(lambda a, b: a.add_(b), [torch.ones(2), torch.ones(2)]) \
        == frozenset({0})
    assert layouts.written_inputs(torch.add, [torch.ones(2), torch.ones(2)]) == frozenset()
