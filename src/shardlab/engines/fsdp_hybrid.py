"""`fsdp`'s hybrid sharding (HSDP): where a reduce-scattered slice goes when the N ranks are R
replicas of S-rank shard groups (`shard_size` S < N): `ReplicaReduce`, the all-reduce over the
replicas, then `shard.grad`. With S = N a slice passes straight on. The schedule around it is
engines/fsdp.py's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardlab.engines import _hooks, collectives

# [Note: hybrid sharding]
# With shard_size=S < N (HSDP) the N ranks form R = N/S shard groups of S consecutive ranks
# ({0..S-1}, {S..2S-1}, ...; on a cluster, one node each when S is the ranks per node) and S
# replica groups of the ranks holding the same slice ({0, S, 2S, ...}, ...), made once by
# `collectives.hybrid_groups`. Everything else happens within the shard group: buffers are
# padded to a multiple of S, rank r keeps slice (r mod S), gathers and reduce-scatters run
# over S ranks. The reduce-scatter averages over the S ranks; once it completes, the slice is
# all-reduced (averaged) over the R replicas, asynchronously, so the result is the mean over
# all N ([Note: why average]); those all-reduces are waited for at the end of backward, in
# launch order. Model state per rank is 16Psi/S, the price of keeping the heavy gather and
# reduce-scatter traffic inside a node: only 2(R-1)/R x 4Psi/S bytes per rank cross nodes.
# Replicas hold equal shards, so the gradient norm is summed over the shard group only
# (`grad_norm_group`), and a checkpoint's pieces are described once per replica: DCP keeps
# one writer per identical chunk. S = N is plain FSDP (no replica group, no all-reduce).

class ReplicaReduce:
    """Where a reduce-scattered slice goes: with a replica group, an async all-reduce over it
    first (waited for in `finish`, in launch order, the same on every rank); then into
    `shard.grad` (through the host with offload: `_hooks.ReducedGrads`)."""

    def __init__(self, group: Any, counter: collectives.CommCounter, grads: _hooks.ReducedGrads):
        self.group, self.counter, self.grads = group, counter, grads
        self._pending: list[tuple[nn.Parameter, torch.Tensor, Any]] = []  # (shard, slice, handle)

    def add(self, shard: nn.Parameter, out: torch.Tensor) -> None:
        if self.group is None:
            self.grads.add(shard, out)
            return
        # averaged over the S ranks of the shard group, now over the R replicas: the mean over N
        handle = collectives.all_reduce(out, self.group, average=True, async_op=True, counter=self.counter)
        self._pending.append((shard, out, handle))

    def finish(self) -> None:
        for shard, out, handle in self._pending:
            if handle is not None:
                handle.wait()
            self.grads.add(shard, out)
        self._pending.clear()
        self.grads.flush()
