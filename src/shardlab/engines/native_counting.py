"""How PyTorch's own engines (engines/native.py) count what they send, in the same `CommCounter`
form as the from-scratch engines, through the extension points PyTorch offers, so `metrics.json`
and `shardlab bench` compare like with like: DDP through a communication hook that counts each
bucket and then runs DDP's default all-reduce hook (divide by N, sum: what DDP does without a
hook), FSDP2 through custom all-gather / reduce-scatter objects (`set_custom_all_gather`,
`set_custom_reduce_scatter`) that count and then call the same `dist` functions as FSDP2's
defaults, and with HSDP an all-reduce hook (`set_all_reduce_hook`), which FSDP2 calls with the
slice it has just all-reduced over the replica group. Not counted: DDP's initial broadcast of
the module state (before training, as the from-scratch engines' is excluded from step traffic
too). The same hooks enter each collective in the hang doctor's flight record
(`collectives.issue`; docs/debugging.md), completed when its future completes (DDP) or its wait
returns (FSDP2).

Times (`comm_seconds()`), as `collectives` takes them: FSDP2's blocking calls inside the call,
its async all-gathers from issue until FSDP2's `wait()` returns (a `collectives.TimedWork`);
DDP's bucket all-reduces from issue until the future completes (a callback chained on DDP's
default hook's future: DDP waits on it at the end of backward, so this is when the wait could
first return); FSDP2's HSDP all-reduce from the end of the reduce-scatter before it until the
hook runs right after it (with S = 1 FSDP2 issues no reduce-scatter, so that all-reduce is
counted but not timed).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from shardlab.engines import collectives, raw_collectives


def counting_allreduce_hook(counter: collectives.CommCounter, group: dist.ProcessGroup | None, world: int):
    """A DDP communication hook: count the bucket, then DDP's default all-reduce hook, timed
    until its future completes. It closes over the counter, not the engine: DDP's reducer
    holds it from C++."""
    def hook(_state, bucket):  # unannotated: DDP rejects the string annotations of this module
        issued, entry = collectives.issue(counter, "all_reduce", collectives.nbytes(bucket.buffer()), world, group)

        def done(fut):
            value = fut.value()  # raises if the all-reduce failed: then it neither counts nor completes
            counter.add_seconds("all_reduce", time.perf_counter() - issued)
            collectives.complete(entry)
            return value

        return default_hooks.allreduce_hook(group, bucket).then(done)

    return hook


def counting_fsdp2_comms(counter: collectives.CommCounter, replicas: int,
                          replica_group: dist.ProcessGroup | None) -> tuple[Any, Any, Any]:
    """FSDP2's default all-gather and reduce-scatter, counting each call's payload first
    (the gathered output; the reduce-scattered input) and entering it in the flight record,
    as `collectives` does, and timing it; and an all-reduce hook for HSDP that counts and
    records the slice FSDP2 has just all-reduced over the replica group and times it from the
    end of the reduce-scatter that preceded it (recorded after the fact: a hang inside that
    all-reduce shows as the reduce-scatter before it, completed, and nothing after)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    last_reduce_scatter_end: list[float | None] = [None]

    class CountingAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            issued, entry = collectives.issue(counter, "all_gather", collectives.nbytes(output_tensor), group.size(),
                                              group)
            return collectives.timed(counter, "all_gather", issued,
                                     super().__call__(output_tensor, input_tensor, group, async_op), entry)

    class CountingReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            issued, entry = collectives.issue(counter, "reduce_scatter", collectives.nbytes(input_tensor),
                                              group.size(), group)
            work = collectives.timed(counter, "reduce_scatter", issued,
                                     super().__call__(output_tensor, input_tensor, group, op, async_op), entry)
            last_reduce_scatter_end[0] = time.perf_counter()
            return work

    def all_reduce_hook(reduce_output: torch.Tensor) -> None:
        # called by FSDP2 (HSDP) right after its blocking all-reduce of the reduce-scattered slice; with the
        # doctor on, raw_collectives entered that all-reduce in the record as FSDP2 issued it: only counted here
        if raw_collectives.installed():
            counter.add("all_reduce", collectives.nbytes(reduce_output), replicas)
        else:
            _, entry = collectives.issue(counter, "all_reduce", collectives.nbytes(reduce_output), replicas,
                                         replica_group)
            collectives.complete(entry)
        if last_reduce_scatter_end[0] is not None:
            counter.add_seconds("all_reduce", time.perf_counter() - last_reduce_scatter_end[0])
            last_reduce_scatter_end[0] = None

    return CountingAllGather(), CountingReduceScatter(), all_reduce_hook
