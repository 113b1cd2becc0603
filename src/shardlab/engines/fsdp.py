"""`fsdp`: fully sharded data parallelism from scratch. Parameters, gradients and optimizer
state are sliced over the ranks; each unit's parameters are gathered only while it runs.

engines/fsdp_layout.py cuts the model into units (the wrap units, and the root for the rest)
and lays each unit's parameters end to end in flat groups, of which this rank keeps a 1/S
slice, its shard, as an ordinary `nn.Parameter` (what the optimizer sees). This file is the
schedule, in the order a step meets it:

    pre-forward      all-gather the unit, point its modules at views of the full buffers,
                     start the next unit's all-gather (prefetch)
    post-forward     free it (reshard_after_forward) and hook its outputs' gradients
    pre-backward     all-gather it again, prefetch the unit backward reaches next
    grads computed   free it (each unit's `UnitState` says when)
    post-backward    reduce-scatter each trainable group's flat gradient (averaged);
                     with hybrid sharding then all-reduce the slice over the replicas
    end of backward  wait for every reduction, add the results into `shard.grad`

Who holds what when, memory and traffic per step, and how it relates to FSDP2: docs/engines.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from shardlab.engines import _hooks, collectives
from shardlab.engines.api import CPUOffload, Engine, MixedPrecision, ShardPiece, accumulation_mode, is_meta
from shardlab.engines.fsdp_hybrid import ReplicaReduce
from shardlab.engines.fsdp_layout import (
    FlatGroup,
    FlatUnit,
    ShardSpec,
    Storage,
    build_flat_units,
    slice_pieces,
)
from shardlab.engines.measuring import Measurable, MemoryTracking
from shardlab.engines.planning import Collective, LocalTensor, ModelTraffic, Plannable, gathered_unit_traffic
from shardlab.models.init import canonical_names

MAX_UNITS_REDUCING = 1  # see [Note: how many reduce-scatters may be in flight]


class FSDPEngine(Engine, Plannable, Measurable):
    """reshard_after_forward: free each unit after its forward (False: keep it gathered until its
    backward, one all-gather less per step for the whole model's parameters in memory).
    mixed_precision: gather and compute in `param_dtype`, reduce-scatter in `reduce_dtype`;
    shards, their gradients and the optimizer state stay in the parameters' own dtype.
    prefetch: start the all-gather of the unit that runs next while this one computes.
    shard_size: S < N shards over S ranks and replicates over N/S
    ([Note: hybrid sharding] in engines/fsdp_hybrid.py).
    offload: CPUOffload keeps the shards, their gradients and so the optimizer state in host
    memory ([Note: CPU offload]).
    accumulate: "sharded" reduce-scatters every micro batch into the shard ([Note: sharded
    accumulation] in engines/api.py); "local" keeps the unsharded sum until the last."""

    grads_sharded = True
    options = ("reshard_after_forward", "mixed_precision", "prefetch", "shard_size", "offload", "accumulate")

    def __init__(self, module: nn.Module, *, reshard_after_forward: bool = True, mixed_precision: Any = None,
                 prefetch: bool = True, shard_size: int | None = None, offload: Any = None,
                 accumulate: str = "local", **kw: Any):
        super().__init__(module, **kw)
        self.accumulate = accumulation_mode(accumulate)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.prefetch = bool(prefetch)
        self.hybrid = collectives.hybrid_groups(self.group, shard_size)
        self.shard_group, self.replica_group = self.hybrid.shard, self.hybrid.replicate
        self.shard_size, self.shard_rank = self.hybrid.shard_size, self.hybrid.shard_rank
        self.grad_norm_group = self.shard_group  # replicas hold equal gradients: count each shard once
        self.offload = CPUOffload.parse(offload)
        mp = MixedPrecision.parse(mixed_precision) or MixedPrecision()
        # None: each group computes and communicates in its parameters' own dtype.
        self.param_dtype = mp.param_dtype
        self.reduce_dtype = mp.reduce_dtype or mp.param_dtype
        self.counter = collectives.CommCounter()           # over the shard group
        self.replica_counter = collectives.CommCounter()   # all-reduces over the replica group
        self.sync_grads = True
        self._backward_end = _hooks.BackwardEnd(self._finish_backward)
        # reduce-scatters in flight, oldest first: (group, output shard, input full gradient, handle)
        self._pending_reduces: list[tuple[FlatGroup, torch.Tensor, torch.Tensor, Any]] = []
        # where a reduced slice goes: [Note: hybrid sharding] in engines/fsdp_hybrid.py, then [Note: CPU offload]
        self._replica_reduce = ReplicaReduce(self.replica_group, self.replica_counter,
                                             _hooks.ReducedGrads(self.offload, self.device))
        self._forward_order: list[FlatUnit] = []
        self._build(module)
        self._install_hooks()

    # -- construction ---------------------------------------------------------------------------
    def _build(self, root: nn.Module) -> None:
        """The flat units (engines/fsdp_layout.py), and buffers equal to rank 0's."""
        names = canonical_names(root)
        meta = is_meta(root)
        self.state_keys = _hooks.StateDictMirror(root, lambda p: names[id(p)])
        spec = ShardSpec(self.device, self.shard_size, self.shard_rank, self.offload, self.param_dtype)
        self.flat_units: list[FlatUnit] = build_flat_units(root, self.units, names, spec, meta=meta)
        self.groups: list[FlatGroup] = [g for u in self.flat_units for g in u.groups]
        # Buffers stay whole on every rank; rank 0's values win (as in DDP).
        _hooks.broadcast_from_rank0(root.buffers(), self.group, self.counter)
        first = self.flat_units[0] if self.flat_units else None
        self.root_unit: FlatUnit | None = first if first is not None and first.is_root else None
        self.wrap_units = [u for u in self.flat_units if not u.is_root]
        self._unit_index = {id(u): i for i, u in enumerate(self.wrap_units)}

    def _install_hooks(self) -> None:
        """The hooks that live as long as the engine; those of a step are made as it runs: on the
        views (`_use_views`), the outputs (`_hook_outputs`) and the inputs (`_arm_inputs`)."""
        for g in self.groups:
            if g.trainable:  # see [Note: one gradient per flat group]
                g.full.register_post_accumulate_grad_hook(_hooks.weak_hook(self._post_backward, g))
        root = self.module
        root.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True)
        root.register_forward_hook(self._root_post_forward)
        for u in self.wrap_units:
            # prepend: gather before any other pre-hook (a composable checkpoint's) sees the unit run
            u.module.register_forward_pre_hook(lambda m, a, k, u=u: self._pre_forward(u, a, k),
                                               with_kwargs=True, prepend=True)
            u.module.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out))

    # -- gather / free --------------------------------------------------------------------------
    # [Note: freeing storage under autograd's feet]
    # Autograd saved views of `full` for backward (e.g. a Linear's weight). Freeing resizes the
    # underlying storage to zero bytes and regathering resizes it back and writes into it, so
    # those saved views see the regathered values. The writes go through `full.data`, which has
    # its own version counter, so autograd's in-place check is not tripped by the refill. An
    # async all-gather is waited for right before its buffer is read (pre-forward, pre-backward)
    # or freed.

    def _start_gather(self, u: FlatUnit, async_op: bool) -> None:
        if u.storage is not Storage.SHARDED:
            return
        in_flight = False
        for g in u.groups:
            g.full_data.untyped_storage().resize_(g.full_data.numel() * g.full_data.element_size())
            g.send = self._shard_on_device(g)
            g.handle = collectives.all_gather_into(g.full_data, g.send, self.shard_group, async_op=async_op,
                                                   counter=self.counter)
            in_flight |= g.handle is not None and async_op
        u.storage = Storage.GATHERING if in_flight else Storage.GATHERED

    # [Note: CPU offload]
    # With offload=CPUOffload() each shard lives in host memory (pinned where CUDA exists), so its
    # gradient and the optimizer state built on it do too, and the optimizer step runs on the
    # CPU. A gather first copies the shard to the device (below: explicit even when the device is
    # the CPU, so the path runs in the CPU tests; asynchronous from pinned memory, ordered before
    # the all-gather on the same stream). A reduced slice goes back through
    # `_hooks.ReducedGrads`: copied into a fresh host tensor, added into `shard.grad` at the end
    # of backward. The unsharded no_sync accumulator stays on the device. Device memory then holds
    # no model state between steps: only the units in flight, their gradients and the activations.

    def _shard_on_device(self, g: FlatGroup) -> torch.Tensor:
        """What this rank sends in a gather: its shard in the compute dtype, on the device (without
        offload and mixed precision the shard itself, no copy)."""
        shard = g.shard.detach()
        if self.offload is None:
            return shard.to(g.full.dtype)
        send = torch.empty(shard.numel(), dtype=g.full.dtype, device=self.device)
        send.copy_(shard, non_blocking=shard.is_pinned())
        return send

    def _wait_gather(self, u: FlatUnit) -> None:
        if u.storage is Storage.GATHERING:
            for g in u.groups:
                if g.handle is not None:
                    g.handle.wait()
            u.storage = Storage.GATHERED
        for g in u.groups:
            g.handle = g.send = None

    def _gather(self, u: FlatUnit) -> None:
        self._start_gather(u, async_op=False)
        self._wait_gather(u)

    def _reshard(self, u: FlatUnit) -> None:
        if u.storage is Storage.SHARDED:
            return
        self._wait_gather(u)
        for g in u.groups:
            g.full_data.untyped_storage().resize_(0)
        u.storage = Storage.SHARDED

    # [Note: one gradient per flat group]
    # A trainable group's full buffer is a leaf tensor `full` (requires_grad); the original
    # parameters are `full.split(sizes)` viewed to their shapes. Autograd therefore sums every use
    # of every parameter of the group (tied names, a unit called twice) into one SplitBackward
    # node, which concatenates them into one flat gradient (zeros for unused parameters and for
    # the padding) and hands it to `full`'s AccumulateGrad exactly once, after the group's last
    # gradient contribution. Its post-accumulate hook is our post-backward: no counting, and (for a
    # unit without frozen groups) it does not depend on the unit's inputs requiring grad. The
    # pre-backward is a hook on the gradient of each forward output; the first one to fire
    # gathers, later ones find the unit gathered. Frozen groups' views are plain views: nothing of
    # theirs reaches autograd.

    def _use_views(self, u: FlatUnit) -> None:
        """Point every binding at its view of the full buffers."""
        grad = torch.is_grad_enabled()
        if grad:
            u.state.ran_forward()  # its backward reads these parameters (even frozen ones)
        if u.state.views_tracked:  # a unit used twice keeps its first views: one gradient sum
            return
        track = grad and u.state.trainable > 0
        for g in u.groups:
            with torch.set_grad_enabled(track and g.trainable):
                for e, piece in zip(g.entries, torch.split(g.full, g.sizes)):
                    view = piece.view(e.shape)
                    if track and g.trainable:  # see [Note: freeing a unit before its flat gradient exists]
                        view.register_hook(_hooks.weak_hook(self._group_grads_computed, g))
                    for m, attr in e.bindings:
                        setattr(m, attr, view)
        if track:
            u.state.connected_views()

    # -- forward hooks --------------------------------------------------------------------------
    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _hooks.cast_floating(args, self.param_dtype), _hooks.cast_floating(kwargs, self.param_dtype)

    def _arm_inputs(self, u: FlatUnit, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():  # [Note: when a unit with frozen parameters may be freed] in engines/_hooks.py
            u.state.release.arm(args, kwargs, lambda _grads, u=u: self._inputs_done(u))

    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if _hooks.in_backward():
            return None
        if not any(u.state.backward_due for u in self.flat_units):
            self._forward_order.clear()  # the last forward's backward is done (or never comes)
        first_unit = self.wrap_units[0] if self.wrap_units else None
        if self.root_unit is not None:
            self._gather_for_forward(self.root_unit, first_unit)
            args, kwargs = self._cast_inputs(args, kwargs)
            self._arm_inputs(self.root_unit, args, kwargs)
            return args, kwargs
        if self.prefetch and first_unit is not None:
            self._start_gather(first_unit, async_op=True)
        return self._cast_inputs(args, kwargs)

    def _root_post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if _hooks.in_backward():
            return
        if not torch.is_grad_enabled():
            # No backward will follow: free everything, including unused prefetches.
            for u in self.flat_units:
                self._reshard(u)
            return
        if self.root_unit is not None:
            self._hook_outputs(self.root_unit, output)

    def _gather_for_forward(self, u: FlatUnit, prefetch: FlatUnit | None) -> None:
        self._start_gather(u, async_op=True)
        if self.prefetch and prefetch is not None:
            self._start_gather(prefetch, async_op=True)
        self._wait_gather(u)
        self._use_views(u)

    def _pre_forward(self, u: FlatUnit, args: tuple, kwargs: dict):
        if _hooks.in_backward():  # [Note: forward hooks inside backward]: just make sure it is gathered
            self._gather(u)
            return None
        i = self._unit_index[id(u)]
        nxt = self.wrap_units[i + 1] if i + 1 < len(self.wrap_units) else None
        self._gather_for_forward(u, nxt)
        if torch.is_grad_enabled():
            self._forward_order.append(u)
        args, kwargs = self._cast_inputs(args, kwargs)
        self._arm_inputs(u, args, kwargs)
        return args, kwargs

    def _post_forward(self, u: FlatUnit, output: Any) -> None:
        if _hooks.in_backward():
            return
        if not torch.is_grad_enabled():
            self._reshard(u)
            return
        if self.reshard_after_forward:
            self._reshard(u)
        self._hook_outputs(u, output)

    def _hook_outputs(self, u: FlatUnit, output: Any) -> None:
        _hooks.hook_output_grads(output, lambda _grad, u=u: self._pre_backward(u))

    # -- backward hooks -------------------------------------------------------------------------
    def _pre_backward(self, u: FlatUnit) -> None:
        self._backward_end.arm()
        if not u.state.backward_due:
            return
        if u.storage is Storage.SHARDED:
            self._start_gather(u, async_op=True)
        nxt = self._backward_prefetch(u) if self.prefetch and not u.is_root else None
        if nxt is not None:
            self._start_gather(nxt, async_op=True)
        self._wait_gather(u)

    # [Note: prefetch order]
    # Forward prefetch follows the unit order (`wrap_units` is forward order); backward prefetch
    # follows the reverse of the order in which units actually ran forward in this step. A
    # prefetch is only a head start: a prefetched unit not used is freed at the end of the
    # forward (no grad) or of the backward.

    def _backward_prefetch(self, u: FlatUnit) -> FlatUnit | None:
        """The unit whose backward comes after `u`'s: the last one before `u`'s last forward that
        still needs its backward."""
        order = self._forward_order
        i = len(order) - 1 - order[::-1].index(u) if u in order else -1
        for prev in reversed(order[:max(i, 0)]):
            if prev is not u and prev.state.backward_due:
                return prev
        return None

    # [Note: freeing a unit before its flat gradient exists]
    # The views of a group are the outputs of one SplitBackward node, and a hook on a non-leaf
    # tensor runs as that node is about to execute: once the gradients of all the group's
    # parameters are computed, i.e. once every node that read them has run (each such node has
    # the parameter as a differentiable input; frozen ones are the exception, hence units with
    # frozen groups wait as [Note: when a unit with frozen parameters may be freed] says, in
    # engines/_hooks.py). SplitBackward then allocates the flat gradient (a unit's worth of bytes)
    # while the per-parameter gradients still exist. Freeing the gathered parameters in the hook,
    # before that allocation, takes one unit off the backward peak (measured on gpt2-small at
    # N=4: 27 MiB of 457). The hooks of one node all fire together; the first does the work.

    def _group_grads_computed(self, g: FlatGroup, _grad: torch.Tensor | None = None) -> None:
        if g.unit.state.grads_computed(id(g)):
            self._reshard(g.unit)

    def _inputs_done(self, u: FlatUnit) -> None:
        self._backward_end.arm()
        if u.state.inputs_arrived():
            self._finish_unit(u)

    def _finish_unit(self, u: FlatUnit) -> None:
        u.state.finished()
        self._reshard(u)

    def _post_backward(self, g: FlatGroup, _full: torch.Tensor | None = None) -> None:
        self._backward_end.arm()
        full_grad, g.full.grad = g.full.grad, None
        if g.unit.state.grad_arrived():
            self._finish_unit(g.unit)
        if full_grad is None:
            return
        if not self.sync_grads:
            # [no_sync] keep the whole local gradient (ours alone: autograd handed it over); reduce
            # the sum on the next synced backward.
            g.unsynced.keep(full_grad, g.shard.dtype, copy=False)
            return
        # rebound, not passed on: a flat gradient cast to the reduce dtype is freed here, not held
        # while older reduce-scatters are waited for
        full_grad = g.unsynced.take(full_grad).to(self.reduce_dtype or g.shard.dtype)
        self._reduce_scatter(g, full_grad)

    # [Note: how many reduce-scatters may be in flight]
    # A reduce-scatter's input is the unit's whole unsharded gradient (4 bytes per parameter in
    # fp32, not divided by N), and it must stay alive until the collective completes. Keeping
    # every one until the end of backward would hold the whole model's gradient at once, at
    # every N: the peak would not fall with N (measured: 1.3 GiB against FSDP2's 0.74 GiB per
    # rank for gpt2-small at N=2). So the gradients of at most MAX_UNITS_REDUCING units are in
    # flight: when another unit's would make one more, the oldest reduce-scatter is waited for
    # and its input freed. One is enough to overlap: a unit's reduce-scatter runs while the next
    # unit's backward computes, and is waited for when that unit's gradient arrives (FSDP2
    # likewise waits for the previous reduce-scatter at each post-backward). Two held three
    # units' gradients at the peak (797 against 770 MiB on gpt2-small at N=2). Units are
    # counted, not bytes: a byte cap set by the largest unit (the embedding) would let many
    # small blocks pile up. (zero3 counts bytes, for reasons of its own: [Note: how many reduces
    # may be in flight] in engines/zero3.py.)

    def _reduce_scatter(self, g: FlatGroup, full_grad: torch.Tensor) -> None:
        """Start the reduce-scatter of a group's flat gradient, in the reduce dtype (averaged:
        [Note: why average]), bounded as the Note above says."""
        out = torch.empty(g.shard.numel(), dtype=full_grad.dtype, device=self.device)
        handle = collectives.reduce_scatter_into(out, full_grad, self.shard_group, average=True, async_op=True,
                                                 counter=self.counter)
        self._pending_reduces.append((g, out, full_grad, handle))
        while len({id(p[0].unit) for p in self._pending_reduces}) > MAX_UNITS_REDUCING:
            self._complete_oldest_reduce()

    @torch.no_grad()
    def _complete_oldest_reduce(self) -> None:
        """Wait for the oldest reduce-scatter in flight, free its input, pass its output on."""
        g, out, _full_grad, handle = self._pending_reduces.pop(0)
        if handle is not None:
            handle.wait()
        self._replica_reduce.add(g.shard, out)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        while self._pending_reduces:
            self._complete_oldest_reduce()
        self._replica_reduce.finish()
        for u in self.flat_units:  # units whose backward never came, or gave no signal (frozen)
            self._finish_unit(u)
        for g in self.groups:
            g.full.grad = None
        self._forward_order.clear()

    # -- the training contract (engines/api.py) ----------------------------------------------------
    @torch.no_grad()
    def _gather_shards(self, g: FlatGroup) -> torch.Tensor:
        """The whole flat buffer in the shard's own dtype (not the compute dtype)."""
        full = torch.empty(g.shard.numel() * self.shard_size, dtype=g.shard.dtype, device=self.device)
        shard = g.shard.detach().to(self.device)  # offloaded: the collective wants it on the device
        collectives.all_gather_into(full, shard, self.shard_group, counter=self.counter)
        return full

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        params: dict[str, torch.Tensor] = {}
        for g in self.groups:
            full = self._gather_shards(g).cpu()
            for e in g.entries:
                params[e.name] = full[e.offset:e.offset + e.numel].view(e.shape).clone()
        return self.state_keys.full(params)

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for g in self.groups:
            g.shard.zero_()
            for piece in self._pieces(g):
                flat = state[piece.name].reshape(-1)
                g.shard[piece.local_start:piece.local_start + piece.numel].copy_(
                    flat[piece.offset:piece.offset + piece.numel])
        self.state_keys.load_buffers(state)

    def _pieces(self, g: FlatGroup) -> list[ShardPiece]:
        n = g.shard.numel()
        return slice_pieces(g.entries, self.shard_rank * n, n)

    def shard_layout(self) -> list[tuple[nn.Parameter, list[ShardPiece]]]:
        """Every group's shard, frozen ones included (a checkpoint must hold every parameter).
        Under HSDP the R replicas of a shard describe the same pieces: DCP writes one of them."""
        return [(g.shard, self._pieces(g)) for g in self.groups]

    # -- Plannable (engines/planning.py) -----------------------------------------------------------
    @classmethod
    def planned_state(cls, params: list[nn.Parameter], world: int, options: Mapping[str, Any]
                      ) -> list[list[LocalTensor]] | None:
        """Flat groups per unit, padded: built, not re-derived."""
        return None

    @classmethod
    def planned_ranks(cls, world: int) -> list[int]:
        """Padding only shrinks the last rank's slice ([Note: padding]): the first and the last tell."""
        return sorted({0, world - 1})

    @classmethod
    def step_traffic(cls, model: ModelTraffic, options: Mapping[str, Any]) -> list[Collective]:
        """Every unit all-gathered in forward and again in backward (not the root, kept gathered),
        gradients reduce-scattered once per step (sharded accumulation: per micro batch) within the
        shard group ([Note: hybrid sharding] in engines/fsdp_hybrid.py)."""
        group = options.get("shard_size") or model.world
        return gathered_unit_traffic(model, "all_gather", "reduce_scatter", group, root_kept=True,
                                     accumulate=options.get("accumulate", "local"))

    # -- Measurable (engines/measuring.py) ---------------------------------------------------------
    def comm_counters(self) -> list[collectives.CommCounter]:
        """All-gathers and reduce-scatters over the shard group (and the wrap-time broadcasts over
        the whole group); all-reduces over the replica group."""
        return [self.counter, self.replica_counter]

    def memory_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for g in self.groups:
            yield "gathered_params", g.full_data       # resized to 0 when sharded
            if g.send is not None:
                yield "comm", g.send                   # the low-precision all-gather input (fp32: the shard)
            if g.unsynced.kept is not None:
                yield "unsharded_grads", g.unsynced.kept  # no_sync accumulation
        for _g, out, full_grad, _handle in self._pending_reduces:
            yield "unsharded_grads", full_grad         # a unit's whole gradient, kept until its reduce-scatter completes
            yield "grads", out                         # the reduce-scatter's output: becomes shard.grad

    def hook_memory_tracker(self, tracker: MemoryTracking) -> None:
        for g in self.groups:  # each group's flat buffer is one leaf for the whole step
            tracker.hook_incoming(g.full, "unsharded_grads")
