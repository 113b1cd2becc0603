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

And the time each kind took, as the caller sees it (`CommCounter.seconds`): for a blocking
call, the wall time inside it; for an async one, from issue until the caller's `wait()` on
the returned handle returns (`TimedWork`). Either way it includes waiting for the slowest
rank to arrive, and for async calls any compute the caller overlapped before waiting: it is
the collective's duration seen from this rank, not the time it was exposed (blocked the
caller). One `perf_counter` pair per call. With NCCL, `wait()` only orders the current CUDA
stream after the collective and returns at once, so on CUDA these seconds are issue times,
not transfer times (docs/benchmarks.md).

And each call is entered in this rank's flight record before it is issued, and marked
completed when it returns (blocking) or its `wait()` does (async): `issue` and `timed`, the
one place the hang doctor hooks (shardlab.doctor, docs/debugging.md). Calls on one rank are
not recorded: nothing can hang there.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardlab.doctor.flight import RECORDER as _flight

ReduceOp = dist.ReduceOp

# torch 2.13 renamed the flat-tensor collectives (all_gather_into_tensor -> all_gather_single,
# reduce_scatter_tensor -> reduce_scatter_single) and deprecated the old names; older releases
# have only the old ones. Same arguments, same semantics.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommCounter:
    """Per-kind totals: {"all_gather": {"calls": n, "payload_bytes": b, "bus_bytes": w}, ...},
    and per-kind seconds apart (`seconds`: the module docstring says what is timed), so the
    byte counts stay exact integers that tests compare across engines."""

    totals: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, kind: str, payload_bytes: int, world: int) -> None:
        factor = 2 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world
        t = self.totals[kind]
        t["calls"] += 1
        t["payload_bytes"] += payload_bytes
        t["bus_bytes"] += int(payload_bytes * factor)

    def add_seconds(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds


def merged_totals(counters: list[CommCounter]) -> dict[str, dict[str, int]]:
    """Per-kind totals of several counters (an engine counting over two groups) summed."""
    out: dict[str, dict[str, int]] = {}
    for c in counters:
        for kind, totals in c.totals.items():
            mine = out.setdefault(kind, {})
            for k, v in totals.items():
                mine[k] = mine.get(k, 0) + v
    return out


def merged_seconds(counters: list[CommCounter]) -> dict[str, float]:
    """Per-kind seconds of several counters summed."""
    out: dict[str, float] = {}
    for c in counters:
        for kind, seconds in c.seconds.items():
            out[kind] = out.get(kind, 0.0) + seconds
    return out


class TimedWork(dist.Work):
    """An async collective's Work handle that adds the time from issue until its first `wait()`
    returns to the counter (if any) and marks its flight record entry (if any) completed. A subclass of `dist.Work` (not a wrapper) because FSDP2 waits only
    on handles that pass `isinstance(work, dist.Work)`; everything else is delegated."""

    def __init__(self, inner: dist.Work, counter: CommCounter | None, kind: str, issued: float, entry: int = 0):
        super().__init__()
        self.inner, self.counter, self.kind, self.issued, self.entry = inner, counter, kind, issued, entry
        self.timed = False

    def wait(self, timeout=None):  # noqa: ANN001 - torch's signature
        if not self.timed:  # from here the rank is blocked: the collective's exposed time (observe/)
            _flight.waiting(self.entry)
        done = self.inner.wait() if timeout is None else self.inner.wait(timeout)
        if not self.timed:
            self.timed = True
            if self.counter is not None:
                self.counter.add_seconds(self.kind, time.perf_counter() - self.issued)
            _flight.complete(self.entry)
        return done

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def is_success(self) -> bool:
        return self.inner.is_success()

    def exception(self):  # noqa: ANN201
        return self.inner.exception()

    def get_future(self):  # noqa: ANN201
        return self.inner.get_future()

    def source_rank(self) -> int:
        return self.inner.source_rank()

    def result(self):  # noqa: ANN201
        return self.inner.result()

    def synchronize(self) -> None:
        self.inner.synchronize()


def issue(counter: CommCounter | None, kind: str, size: int, world: int, group) -> tuple[float, int]:
    """Before a collective is issued: count it, enter it in the flight record (on more than one
    rank), and start its clock. Returns (issue time, flight entry number; 0: not recorded)."""
    if counter is not None:
        counter.add(kind, size, world)
    return time.perf_counter(), (_flight.issue(kind, size, group) if world > 1 else 0)


def complete(entry: int) -> None:
    """Mark flight entry `entry` (from `issue`) completed: for hooks that see the end themselves
    (a future's callback, which this rank's main thread did not wait on: not exposed time)."""
    _flight.complete(entry, waited=False)


def timed(counter: CommCounter | None, kind: str, issued: float, work: dist.Work | None, entry: int = 0):
    """What a collective returns, timed: a blocking call (work None) adds its time and completes
    its flight entry now; an async one returns a TimedWork that does both at `wait()`."""
    if work is None:
        if counter is not None:
            counter.add_seconds(kind, time.perf_counter() - issued)
        _flight.complete(entry)
        return None
    if counter is None and not entry:
        return work
    return TimedWork(work, counter, kind, issued, entry)


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements: what a collective counts as its payload."""
    return t.numel() * t.element_size()


def _dist_broadcast(tensor: torch.Tensor, src: int, group, async_op: bool):
    return dist.broadcast(tensor, src=dist.get_global_rank(group, src) if group is not None else src,
                          group=group, async_op=async_op)


def _in_place(kind: str, tensor: torch.Tensor, group, counter: CommCounter | None,
              call: Callable[[], dist.Work | None], *, average: bool = False):
    """One collective on `tensor` in place, counted, recorded and timed; `call()` issues it (on
    one rank nothing is sent: the tensor already is the result). average: divide by the world
    size before the sum, which keeps low-precision values in range, and the result is the mean."""
    world = _world(group)
    issued, entry = issue(counter, kind, nbytes(tensor), world, group)
    if world == 1:
        return timed(counter, kind, issued, None)
    if average:
        tensor.div_(world)
    return timed(counter, kind, issued, call(), entry)


def all_reduce(tensor: torch.Tensor, group=None, *, average: bool = False, async_op: bool = False,
               counter: CommCounter | None = None, op: dist.ReduceOp.RedOpType = ReduceOp.SUM):
    """Sum (or average, or `op`: MAX for a flag or an inf-norm) `tensor` in place across the group."""
    if average and op != ReduceOp.SUM:
        raise ValueError("average=True is a sum divided by the world size; it takes no other op")
    return _in_place("all_reduce", tensor, group, counter,
                     lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), average=average)


def broadcast(tensor: torch.Tensor, src: int, group=None, *, async_op: bool = False,
              counter: CommCounter | None = None):
    """Copy `tensor` from group rank `src` to every rank, in place."""
    return _in_place("broadcast", tensor, group, counter, lambda: _dist_broadcast(tensor, src, group, async_op))


def reduce(tensor: torch.Tensor, dst: int, group=None, *, average: bool = False, async_op: bool = False,
           counter: CommCounter | None = None):
    """Sum (or average) `tensor` onto group rank `dst`; other ranks' tensors are undefined after."""
    def call() -> dist.Work | None:
        rank = dist.get_global_rank(group, dst) if group is not None else dst
        return dist.reduce(tensor, dst=rank, op=ReduceOp.SUM, group=group, async_op=async_op)

    return _in_place("reduce", tensor, group, counter, call, average=average)


# [Note: flat collectives on CPU, without gloo's temporaries]
# On CPU tensors (gloo), torch's flat collectives allocate a unit-sized temporary per call
# (ProcessGroupGloo.cpp, torch 2.13): all_gather_into_tensor gathers into a new tensor the
# size of the output and then copies it out, and reduce_scatter_tensor clones its whole
# input, all-reduces the clone and copies one chunk out. Those allocations happen on gloo's
# worker threads, one per call, and glibc keeps much of what they free: on 2 gloo ranks, 5
# all-gathers of a 27 MiB buffer took RSS from 263 to 373 MiB where broadcasts and
# all-reduces of the same buffer stayed flat; fsdp's peak RSS was 0.72x ddp's on gpt2-small
# at N=4 where zero3 (broadcast and reduce) was at 0.52x (docs/memory.md). So on CPU these
# two functions do the same collectives from calls that write in place:
# - all-gather: this rank's shard is copied into its own chunk of `output`, then N
#   broadcasts, rank r the source of chunk r. Each rank sends its shard and receives the
#   N-1 others once, the all-gather's traffic, counted and timed as one all-gather.
# - reduce-scatter: an all-reduce in place on `full` (the caller gives it up: "may be
#   modified"), then a copy of this rank's chunk out: what gloo does, without the clone.
#   On the wire that is an all-reduce, as it was inside gloo; it is counted as the
#   reduce-scatter it implements, so the byte counts say what the algorithm needs and stay
#   comparable with NCCL's (docs/benchmarks.md).
# With them fsdp's peak RSS at N=4 fell to 0.54x ddp's, and its gpt2-small step from 6.1 to
# 4.0 s (no copy out, no clone); on gpt-mini at N=2 its throughput did not change.
# CUDA tensors take the flat collectives unchanged: NCCL writes into the buffers given.


class _AllDone(dist.Work):
    """Several in-flight collectives as one handle: `wait()` waits for each in issue order, then
    runs `then` once (a copy out of a buffer the collectives wrote)."""

    def __init__(self, works: list, then=None):  # noqa: ANN001
        super().__init__()
        self.works, self.then = [w for w in works if w is not None], then

    def wait(self, timeout=None):  # noqa: ANN001 - torch's signature
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True

    def is_completed(self) -> bool:
        return self.then is None and all(w.is_completed() for w in self.works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self.works)


def _in_place_on_cpu(t: torch.Tensor) -> bool:
    """Whether to take the CPU form of [Note: flat collectives on CPU, without gloo's temporaries]."""
    return t.device.type == "cpu"


def _finish(work: dist.Work, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group=None, *, async_op: bool = False,
                    counter: CommCounter | None = None):
    """Concatenate every rank's equal-sized `shard` into `output` (numel = world x shard numel)."""
    world = _world(group)
    if output.numel() != shard.numel() * world:
        raise ValueError(f"all_gather_into: output has {output.numel()} elements, expected {world} x {shard.numel()}")
    issued, entry = issue(counter, "all_gather", nbytes(output), world, group)
    if world == 1:
        output.copy_(shard.view_as(output))
        return timed(counter, "all_gather", issued, None)
    if not _in_place_on_cpu(output):
        return timed(counter, "all_gather", issued, _all_gather_flat(output, shard, group=group, async_op=async_op),
                     entry)
    chunks = output.view(-1).chunk(world)
    chunks[dist.get_rank(group)].copy_(shard.view(-1))
    # rank r's chunk from rank r; neither counted nor recorded apart: the one all-gather above
    works = [_dist_broadcast(chunk, r, group, True) for r, chunk in enumerate(chunks)]
    return timed(counter, "all_gather", issued, _finish(_AllDone(works), async_op), entry)


def reduce_scatter_into(shard: torch.Tensor, full: torch.Tensor, group=None, *, average: bool = True,
                        async_op: bool = False, counter: CommCounter | None = None):
    """Sum (or average) `full` across ranks and leave rank r's r-th chunk in `shard`.
    `full` may be modified (it is divided in place when averaging; on CPU it is all-reduced)."""
    world = _world(group)
    if full.numel() != shard.numel() * world:
        raise ValueError(f"reduce_scatter_into: input has {full.numel()} elements, expected {world} x {shard.numel()}")
    issued, entry = issue(counter, "reduce_scatter", nbytes(full), world, group)
    if average and world > 1:
        full.div_(world)
    if world == 1:
        shard.copy_(full.view_as(shard))
        return timed(counter, "reduce_scatter", issued, None)
    if not _in_place_on_cpu(full):
        return timed(counter, "reduce_scatter", issued,
                     _reduce_scatter_flat(shard, full, op=ReduceOp.SUM, group=group, async_op=async_op), entry)
    mine = full.view(-1).chunk(world)[dist.get_rank(group)]
    # neither counted nor recorded apart: one reduce-scatter (averaged above)
    work = dist.all_reduce(full, op=ReduceOp.SUM, group=group, async_op=True)
    return timed(counter, "reduce_scatter", issued,
                 _finish(_AllDone([work], then=lambda: shard.view(-1).copy_(mine)), async_op), entry)


# ---------------------------------------------------------------------------- hybrid sharding groups
def ranks_per_node() -> int | None:
    """The ranks on this node, from the launcher's environment: torchrun's LOCAL_WORLD_SIZE, or
    Slurm's SLURM_NTASKS_PER_NODE when srun starts the workers itself (no torchrun: RANK unset,
    as runtime.env_world reads it); None when neither says."""
    env = os.environ
    candidates = [env.get("LOCAL_WORLD_SIZE", "")]
    if "RANK" not in env and "SLURM_PROCID" in env:
        candidates.append(env.get("SLURM_NTASKS_PER_NODE", ""))
    for value in candidates:
        if value.isdigit() and int(value) >= 1:
            return int(value)
    return None


def resolve_shard_size(shard_size: int | None, world: int) -> int:
    """The shard group size S for `world` ranks: `shard_size`, or by default the ranks per node
    (so sharding traffic stays on a node's fast links), or the whole world when that is unknown.
    Raises ValueError naming `parallel.shard_size` and the fix when S cannot divide the world."""
    where = "parallel.shard_size"
    if shard_size is None:
        per_node = ranks_per_node()
        if per_node is None or per_node >= world:
            return world
        if world % per_node:
            raise ValueError(f"{where} defaults to the ranks per node ({per_node}), which does not divide the "
                             f"world size {world}; set {where} to a divisor of {world}")
        return per_node
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1:
        raise ValueError(f"{where} must be an integer >= 1, got {shard_size!r}")
    if shard_size > world or world % shard_size:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"{where}={shard_size} must divide the world size {world} (shard groups of S ranks, "
                         f"replicated {world}/S times); use one of {divisors}")
    return shard_size


@dataclass(frozen=True)
class HybridGroups:
    """The groups of hybrid sharding over a parent group of N = R x S ranks.

    shard group:   S consecutive parent ranks, {0..S-1}, {S..2S-1}, ...: parameters are
                   sharded over it (all-gather, reduce-scatter);
    replica group: the ranks holding the same shard, {0, S, 2S, ...}, {1, S+1, ...}: gradients
                   are all-reduced over it.
    With S = N the shard group is the parent group itself and the replica group is one rank
    (plain FSDP: nothing is all-reduced)."""

    shard: dist.ProcessGroup | None
    replicate: dist.ProcessGroup | None
    shard_size: int          # S
    replicas: int            # R = N / S
    shard_rank: int          # rank within the shard group: which shard this rank holds
    replica_rank: int        # rank within the replica group: which replica it belongs to
    shard_ranks: tuple[int, ...] = ()      # global ranks of this rank's shard group
    replica_ranks: tuple[int, ...] = ()    # global ranks of this rank's replica group


_HYBRID_CACHE: dict[tuple, tuple[object, HybridGroups]] = {}


def hybrid_groups(group: dist.ProcessGroup | None, shard_size: int) -> HybridGroups:
    """Create (once per parent group and S, then reuse) the shard and replica groups.

    Every rank of the default group calls `dist.new_group` for every subgroup, in the same
    order (R shard groups, then S replica groups), as torch.distributed requires, even for
    groups it is not a member of. Engines built again on the same group (tests build many)
    reuse the groups instead of opening new connections each time."""
    world = _world(group)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    shard_size = resolve_shard_size(shard_size, world)
    replicas = world // shard_size
    shard_rank, replica_rank = rank % shard_size, rank // shard_size
    if replicas == 1:  # plain FSDP: the parent group is the shard group, no replica group
        return HybridGroups(group, None, shard_size, 1, shard_rank, 0)
    default = dist.distributed_c10d._get_default_group()
    if group is not None and group != dist.group.WORLD and dist.get_world_size(group) != dist.get_world_size():
        # new_group must be called by every rank of the default group: ranks outside `group`
        # never get here, so the subgroups cannot be created consistently.
        raise NotImplementedError("hybrid sharding (shard_size < group size) needs the engine's group to be the "
                                  "whole world; pass group=None or shard_size equal to the group size")
    parent = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    key = (id(default), tuple(parent), shard_size)
    cached = _HYBRID_CACHE.get(key)
    if cached is not None and cached[0] is default:
        return cached[1]
    shard_sets = [tuple(parent[i * shard_size:(i + 1) * shard_size]) for i in range(replicas)]
    replica_sets = [tuple(parent[j::shard_size]) for j in range(shard_size)]
    made = {}
    for ranks in shard_sets + replica_sets:  # same order on every rank
        made[ranks] = dist.new_group(list(ranks))
    mine_shard, mine_replica = shard_sets[replica_rank], replica_sets[shard_rank]
    result = HybridGroups(made[mine_shard], made[mine_replica], shard_size, replicas, shard_rank, replica_rank,
                          mine_shard, mine_replica)
    _HYBRID_CACHE[key] = (default, result)
    return result
