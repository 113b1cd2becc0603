"""Collectives as pure functions over torch.distributed, each counting what it moves.

Every from-scratch engine communicates only through these functions, so the benchmark can
report bytes per operation kind for any engine, and the traffic formulas in docs/engines.md
can be checked against what was actually sent.

Two numbers per call, in the convention of nccl-tests:
- `payload_bytes`: the size of the logical tensor the collective is about (the all-reduced
  tensor, the gathered output, the reduce-scattered input, the broadcast tensor);
- `bus_bytes`: what one rank sends, on average over the ranks, with ring/chain algorithms:
  payload x 2(N-1)/N for all-reduce; x (N-1)/N for all-gather and reduce-scatter; and
  x (N-1)/N for broadcast and reduce too, since on a pipelined chain N-1 of the N ranks
  forward the payload once (nothing for N = 1, where every function here is a local copy).
Async calls return the torch.distributed Work handle (or None when nothing was sent).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

# torch 2.13 renamed the flat-tensor collectives (all_gather_into_tensor -> all_gather_single,
# reduce_scatter_tensor -> reduce_scatter_single) and deprecated the old names; older releases
# have only the old ones. Same arguments, same semantics.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommCounter:
    """Per-kind totals: {"all_gather": {"calls": n, "payload_bytes": b, "bus_bytes": w}, ...}."""

    totals: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    def add(self, kind: str, payload_bytes: int, world: int) -> None:
        factor = 2 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world
        t = self.totals[kind]
        t["calls"] += 1
        t["payload_bytes"] += payload_bytes
        t["bus_bytes"] += int(payload_bytes * factor)

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.totals.items()}

    def reset(self) -> None:
        self.totals.clear()


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, group=None, *, average: bool = False, async_op: bool = False,
               counter: CommCounter | None = None):
    """Sum (or average) `tensor` in place across the group."""
    world = _world(group)
    if counter is not None:
        counter.add("all_reduce", _nbytes(tensor), world)
    if world == 1:
        return None
    if average:
        # Divide before the sum: keeps low-precision values in range, and the result is the mean.
        tensor.div_(world)
    return dist.all_reduce(tensor, op=ReduceOp.SUM, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, *, async_op: bool = False,
              counter: CommCounter | None = None):
    """Copy `tensor` from group rank `src` to every rank, in place."""
    world = _world(group)
    if counter is not None:
        counter.add("broadcast", _nbytes(tensor), world)
    if world == 1:
        return None
    return dist.broadcast(tensor, src=dist.get_global_rank(group, src) if group is not None else src,
                          group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, group=None, *, average: bool = False, async_op: bool = False,
           counter: CommCounter | None = None):
    """Sum (or average) `tensor` onto group rank `dst`; other ranks' tensors are undefined after."""
    world = _world(group)
    if counter is not None:
        counter.add("reduce", _nbytes(tensor), world)
    if world == 1:
        return None
    if average:
        tensor.div_(world)
    return dist.reduce(tensor, dst=dist.get_global_rank(group, dst) if group is not None else dst,
                       op=ReduceOp.SUM, group=group, async_op=async_op)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group=None, *, async_op: bool = False,
                    counter: CommCounter | None = None):
    """Concatenate every rank's equal-sized `shard` into `output` (numel = world x shard numel)."""
    world = _world(group)
    if output.numel() != shard.numel() * world:
        raise ValueError(f"all_gather_into: output has {output.numel()} elements, expected {world} x {shard.numel()}")
    if counter is not None:
        counter.add("all_gather", _nbytes(output), world)
    if world == 1:
        output.copy_(shard.view_as(output))
        return None
    return _all_gather_flat(output, shard, group=group, async_op=async_op)


def reduce_scatter_into(shard: torch.Tensor, full: torch.Tensor, group=None, *, average: bool = True,
                        async_op: bool = False, counter: CommCounter | None = None):
    """Sum (or average) `full` across ranks and leave rank r's r-th chunk in `shard`.
    `full` may be modified (it is divided in place when averaging)."""
    world = _world(group)
    if full.numel() != shard.numel() * world:
        raise ValueError(f"reduce_scatter_into: input has {full.numel()} elements, expected {world} x {shard.numel()}")
    if counter is not None:
        counter.add("reduce_scatter", _nbytes(full), world)
    if average and world > 1:
        full.div_(world)
    if world == 1:
        shard.copy_(full.view_as(shard))
        return None
    return _reduce_scatter_flat(shard, full, op=ReduceOp.SUM, group=group, async_op=async_op)
