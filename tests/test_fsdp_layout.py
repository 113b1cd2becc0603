"""fsdp's bookkeeping without processes: which pieces of which parameters a rank's slice holds
(`slice_pieces`), and when a unit is freed in backward (`UnitState`, `FrozenRelease`).
The engine's own runs (tests/test_engine_fsdp.py) check the same through parity and memory."""

from __future__ import annotations

import torch

from shardlab.engines.api import ShardPiece
from shardlab.engines.fsdp_layout import FlatEntry, UnitState, slice_pieces


def _entries(*sizes: int) -> list[FlatEntry]:
    out, offset = [], 0
    for i, n in enumerate(sizes):
        out.append(FlatEntry(f"p{i}", torch.Size([n]), offset, n, []))
        offset += n
    return out


def test_slice_pieces_cover_each_element_once():
    entries = _entries(5, 1, 7)            # 13 elements, padded to 16 for S = 4: slices of 4
    pieces = [slice_pieces(entries, r * 4, 4) for r in range(4)]
    assert pieces[0] == [ShardPiece("p0", torch.Size([5]), 0, 0, 4)]
    assert pieces[1] == [ShardPiece("p0", torch.Size([5]), 4, 0, 1), ShardPiece("p1", torch.Size([1]), 0, 1, 1),
                         ShardPiece("p2", torch.Size([7]), 0, 2, 2)]
    assert pieces[3] == [ShardPiece("p2", torch.Size([7]), 6, 0, 1)]  # then 3 elements of padding
    covered = {e.name: [0] * e.numel for e in entries}
    for rank, mine in enumerate(pieces):
        for p in mine:
            assert 0 <= p.local_start and p.local_start + p.numel <= 4, (rank, p)
            for k in range(p.numel):
                covered[p.name][p.offset + k] += 1
    assert all(c == [1] * len(c) for c in covered.values()), covered


def test_slice_pieces_of_a_slice_in_the_padding_or_between_entries():
    entries = _entries(3, 3)
    assert slice_pieces(entries, 6, 2) == []                 # all padding: no piece
    assert slice_pieces(entries, 3, 0) == []                 # an empty slice touches nothing
    assert slice_pieces(entries, 2, 2) == [ShardPiece("p0", torch.Size([3]), 2, 0, 1),
                                           ShardPiece("p1", torch.Size([3]), 0, 1, 1)]


def test_a_unit_without_frozen_groups_is_freed_once_its_parameters_have_gradients():
    s = UnitState(trainable=2, frozen=False)
    s.ran_forward()
    s.connected_views()
    assert not s.grads_computed(1)
    assert not s.grads_computed(1)         # the other hooks of the same SplitBackward
    assert s.grads_computed(2)             # the last group: free before the flat gradients exist
    assert not s.grad_arrived()
    assert s.grad_arrived()                # both flat gradients in: the unit is done
    s.finished()
    assert s.idle


def test_a_unit_with_frozen_groups_waits_for_its_inputs_gradients():
    s = UnitState(trainable=1, frozen=True)
    s.ran_forward()
    s.connected_views()
    x = torch.ones(2, requires_grad=True)
    for _call in range(2):                 # called twice: two input hooks armed
        s.release.arm((x,), {}, lambda _grads: None)
    assert not s.grads_computed(1)         # a frozen LayerNorm may still read its weight
    assert not s.inputs_arrived()
    assert not s.grad_arrived()            # one call's inputs are still due
    assert s.inputs_arrived()


def test_a_unit_with_frozen_groups_and_no_input_signal_is_held_to_the_end():
    s = UnitState(trainable=1, frozen=True)
    s.ran_forward()
    s.connected_views()
    s.release.arm((torch.ones(2),), {}, lambda _grads: None)   # its inputs need no gradient: no hook
    assert not s.grads_computed(1)
    assert not s.grad_arrived()            # freed by the end of backward instead
