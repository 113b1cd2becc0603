"""FSDP from scratch: every parameter, gradient and optimizer state is sliced across ranks.
How the model is cut into units and flat groups is engines/fsdp_layout.py; this file is the
engine: when units are gathered, freed and reduced.

The algorithm
-------------
The model is cut into *units*: one per wrap unit (a transformer block, a ResNet stage)
and one for the root's remaining parameters (embeddings, tied head, final norm). A
unit's parameters form one *group* per (requires_grad, dtype) present, usually just one:
a group's parameters are laid end to end in one flat buffer, padded to a multiple of the
world size N; rank r keeps elements [r*S, (r+1)*S) (S = padded/N) as an ordinary
`nn.Parameter`, the *shard*, in the parameters' own dtype. Shards are all
`module.parameters()` yields, so any `torch.optim` optimizer updates them and keeps its
state 1/N-sized. A frozen group's shard has requires_grad=False: it is gathered with the
unit, never gets a gradient, and nothing of it is reduce-scattered; optimizers skip it.

Around each unit's forward and backward (hooks only; the model's code runs unchanged):

    pre-forward    all-gather the shards into the full buffer (wait for the prefetch if
                   one is in flight), point module.weight etc. at views of it, and start
                   the all-gather of the next unit (prefetch)
    post-forward   free the full buffer (reshard_after_forward=True) and hook the outputs
    pre-backward   (a hook on the outputs' gradients) all-gather again, prefetch the
                   unit backward reaches next
    post-backward  (each trainable full buffer's grad-accumulation hook) reduce-scatter
                   the full gradient with averaging into a new shard-sized gradient, and
                   free the unit (with frozen groups: see the Note on when that is)
    end of backward  wait for every reduce-scatter, add the results into `shard.grad`

Who holds what, N ranks, units B0 B1 and the root R ('#' gathered, '~' all-gather in
flight, '.' only this rank's 1/N shard):

                     R   B0  B1
    forward B0       #   #   ~     B1 prefetched while B0 computes
    forward B1       #   .   #     B0 freed after its forward
    loss             #   .   .     the root stays gathered: backward needs it at once
    backward B1      #   ~   #     then reduce-scatter B1's gradient, free B1
    backward B0      #   #   .     then reduce-scatter B0's gradient, free B0
    backward R       #   .   .     then reduce-scatter R's gradient, free R
    optimizer step   .   .   .     shards and 1/N gradients only

Memory per rank with AdamW in fp32: 16 bytes per parameter / N (4 shard + 4 grad + 8
Adam moments), plus transiently the gathered parameters of the root and of the one or two
units in flight (the current one and a prefetched one), and the full gradients of at
most two units whose reduce-scatters are in flight. Under `no_sync`, each group additionally keeps its
whole unsharded gradient (4 bytes per parameter in fp32, not divided by N) until the next
synchronized backward: accumulation trades memory for communication. With mixed
precision the gathered copies are in param_dtype (2 bytes for bf16); shards, gradients
and optimizer state stay in the parameters' own dtype (fp32, or fp64 in the parity tests).
Frozen parameters cost 4 bytes / N each (their shard) and nothing else between steps.

Traffic per step, with Psi = parameter bytes: all-gather in forward (Psi), all-gather in
backward (Psi, minus the root group, which stays gathered as backward needs it at once),
reduce-scatter of gradients (Psi): about 3*Psi, each x (N-1)/N bus bytes on a ring.

Why gradients are averaged, when hooks fire and why backward waits at its end: see
[Note: why average], [Note: when the hooks fire] and [Note: why we wait where we wait] in
`engines/api.py`. What is particular to fsdp:

[Note: one gradient per flat group]
A trainable group's full buffer is a leaf tensor `full` (requires_grad); the original parameters are
`full.split(sizes)` viewed to their shapes. Autograd therefore sums every use of every
parameter of the group (tied names, a unit called twice) into one SplitBackward node,
which concatenates them into one flat gradient (zeros for unused parameters and for the
padding) and hands it to `full`'s AccumulateGrad exactly once, after the group's last
gradient contribution. Its post-accumulate hook is our post-backward: no counting, and
(for a unit without frozen parameters) it does not depend on the unit's inputs requiring
grad. The pre-backward is a hook on the gradient of each forward output; the first one to
fire gathers, later ones find the group gathered. With activation checkpointing
(engines/compile.py) the recompute runs the unit's original forward inside backward on the
views the pre-backward re-gathered; its hooks do not fire again. Should a unit's module be
called again in backward (a unit nested in a checkpointed region, or a user's own
composable checkpoint), its pre-forward only makes sure the buffer is gathered: the
recomputed graph is never backpropagated, so nothing is reduce-scattered twice. An async all-gather is waited on
right before its buffer is read (pre-forward, pre-backward) or freed; reduce-scatters are
bounded as [Note: how many reduce-scatters may be in flight] says.

[Note: freeing storage under autograd's feet]
Autograd saved views of `full` for backward (e.g. a Linear's weight). Freeing resizes the
underlying storage to zero bytes and regathering resizes it back and writes into it, so
those saved views see the regathered values. The writes go through `full.data`, which has
its own version counter, so autograd's in-place check is not tripped by the refill.

[Note: padding]
The padded tail of the flat buffer belongs to no parameter. SplitBackward fills it with
zeros, so after averaging its gradient is exactly zero, the optimizer (even with weight
decay) keeps it zero, and `clip_grad_norm_` is unaffected. Shards of equal size make
all-gather and reduce-scatter single calls; a rank may hold no piece of some parameters.

[Note: hybrid sharding]
With shard_size=S < N (HSDP) the N ranks form R = N/S shard groups of S consecutive ranks
({0..S-1}, {S..2S-1}, ...; on a cluster, one node each when S is the ranks per node) and S
replica groups of the ranks holding the same slice ({0, S, 2S, ...}, ...), made once by
`collectives.hybrid_groups`. Everything above happens within the shard group: buffers are
padded to a multiple of S, rank r keeps slice (r mod S), gathers and reduce-scatters run
over S ranks. The reduce-scatter averages over the S ranks; once it completes, the slice
is all-reduced (averaged) over the R replicas, asynchronously, so the result is the mean
over all N ([Note: why average]); those all-reduces are waited for at the end of backward,
in launch order. Model state per rank is 16Psi/S, the price of keeping the heavy gather
and reduce-scatter traffic inside a node: only 2(R-1)/R x 4Psi/S bytes per rank cross
nodes. Replicas hold equal shards, so the gradient norm is summed over the shard group only
(`grad_norm_group`), and a checkpoint's pieces are described once per replica: DCP keeps
one writer per identical chunk. S = N is plain FSDP (no replica group, no all-reduce).

[Note: CPU offload]
With offload=CPUOffload() each shard lives in host memory (pinned where CUDA exists), so
its gradient and the optimizer state built on it do too, and the optimizer step runs on
the CPU. A gather first copies the shard to the device (`_shard_on_device`: explicit even
when the device is the CPU, so the path runs in the CPU tests; asynchronous from pinned
memory, ordered before the all-gather on the same stream). A reduced slice is copied back
into a fresh host tensor, asynchronously into pinned memory, and added into `shard.grad`
only at the end of backward, after synchronizing the stream (the host must not read a
copy still in flight). The unsharded no_sync accumulator stays on the device. Device memory
then holds no model state between steps: only the units in flight, their gradients and the
activations.

[Note: prefetch order]
Forward prefetch follows the unit order (`units` is forward order); backward prefetch
follows the reverse of the order in which units actually ran forward in this step. A
prefetch is only a head start: a prefetched group not used is freed at the end of the
forward (no grad) or of the backward.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from shardlab.engines import _hooks, collectives
from shardlab.engines.api import CPUOffload, Engine, MixedPrecision, ShardPiece, is_meta
from shardlab.engines.fsdp_layout import FlatGroup, FlatUnit, ShardSpec, UnitState, build_flat_units
from shardlab.engines.measuring import Measurable, MemoryTracking
from shardlab.engines.planning import Collective, LocalTensor, ModelTraffic, Plannable, gathered_unit_traffic
from shardlab.models.init import canonical_names

MAX_UNITS_REDUCING = 1  # see [Note: how many reduce-scatters may be in flight]


class FSDPEngine(Engine, Plannable, Measurable):
    grads_sharded = True
    options = ("reshard_after_forward", "mixed_precision", "prefetch", "shard_size", "offload")

    def __init__(self, module: nn.Module, *, reshard_after_forward: bool = True, mixed_precision: Any = None,
                 prefetch: bool = True, shard_size: int | None = None, offload: Any = None, **kw: Any):
        super().__init__(module, **kw)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.prefetch = bool(prefetch)
        # [Note: hybrid sharding] shard over S ranks, replicate over N/S
        self.hybrid = collectives.hybrid_groups(self.group, shard_size)
        self.shard_group, self.replica_group = self.hybrid.shard, self.hybrid.replicate
        self.shard_size, self.shard_rank = self.hybrid.shard_size, self.hybrid.shard_rank
        self.grad_norm_group = self.shard_group  # replicas hold equal gradients: count each shard once
        # [Note: CPU offload] shards, their gradients and the optimizer state on the host
        self.offload = CPUOffload.parse(offload)
        self.replica_counter = collectives.CommCounter()  # all-reduces over the replica group
        self._host_grads = _hooks.HostGrads(self.offload, self.device) if self.offload is not None else None
        self._pending_all_reduces: list[tuple[FlatGroup, torch.Tensor, Any]] = []  # HSDP: (group, shard grad, handle)
        mp = MixedPrecision.parse(mixed_precision) or MixedPrecision()
        # None: each group computes and communicates in its parameters' own dtype.
        self.param_dtype = mp.param_dtype
        self.reduce_dtype = mp.reduce_dtype or mp.param_dtype
        self.counter = collectives.CommCounter()
        self.sync_grads = True
        self._backward_end = _hooks.BackwardEnd(self._finish_backward)
        # reduce-scatters in flight, oldest first: (group, output shard, input full gradient, handle)
        self._pending_reduces: list[tuple[FlatGroup, torch.Tensor, torch.Tensor, Any]] = []
        self._forward_order: list[FlatUnit] = []
        self._build(module)
        self._install_hooks()

    # -- construction ---------------------------------------------------------------------------
    def _build(self, root: nn.Module) -> None:
        """The flat units (engines/fsdp_layout.py), buffers equal to rank 0's, hooks on the gradients."""
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
        for g in self.groups:
            if g.trainable:
                g.full.register_post_accumulate_grad_hook(_hooks.weak_hook(self._post_backward, g))

    def _install_hooks(self) -> None:
        root = self.module
        root.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True)
        root.register_forward_hook(self._root_post_forward)
        for u in self.wrap_units:
            # prepend: gather before any other pre-hook (a composable checkpoint's) sees the unit run
            u.module.register_forward_pre_hook(lambda m, a, k, u=u: self._pre_forward(u, a, k),
                                               with_kwargs=True, prepend=True)
            u.module.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out))

    # -- gather / free --------------------------------------------------------------------------
    def _start_gather(self, u: FlatUnit, async_op: bool) -> None:
        if u.state is not UnitState.SHARDED:
            return
        in_flight = False
        for g in u.groups:
            g.full_data.untyped_storage().resize_(g.full_data.numel() * g.full_data.element_size())
            g.send = self._shard_on_device(g)
            g.handle = collectives.all_gather_into(g.full_data, g.send, self.shard_group, async_op=async_op,
                                                   counter=self.counter)
            in_flight |= g.handle is not None and async_op
        u.state = UnitState.GATHERING if in_flight else UnitState.GATHERED

    def _shard_on_device(self, g: FlatGroup) -> torch.Tensor:
        """What this rank sends in a gather: its shard in the compute dtype, on the device. Without
        offload and mixed precision that is the shard itself (no copy); with offload an explicit
        host-to-device copy, asynchronous from pinned memory (the all-gather is queued behind it
        on the same stream), made even when the device is the CPU, so that path always runs."""
        shard = g.shard.detach()
        if self.offload is None:
            return shard.to(g.full.dtype)
        send = torch.empty(shard.numel(), dtype=g.full.dtype, device=self.device)
        send.copy_(shard, non_blocking=shard.is_pinned())
        return send

    def _wait_gather(self, u: FlatUnit) -> None:
        if u.state is UnitState.GATHERING:
            for g in u.groups:
                if g.handle is not None:
                    g.handle.wait()
            u.state = UnitState.GATHERED
        for g in u.groups:
            g.handle = g.send = None

    def _gather(self, u: FlatUnit) -> None:
        self._start_gather(u, async_op=False)
        self._wait_gather(u)

    def _reshard(self, u: FlatUnit) -> None:
        if u.state is UnitState.SHARDED:
            return
        self._wait_gather(u)
        for g in u.groups:
            g.full_data.untyped_storage().resize_(0)
        u.state = UnitState.SHARDED

    def _use_views(self, u: FlatUnit) -> None:
        """Point every binding at its view of the full buffers. With grad enabled the views of
        trainable groups are autograd-connected to their `full`, so their gradients reach the
        post-backward hook; frozen groups' views are plain views."""
        grad = torch.is_grad_enabled()
        if grad:
            u.needs_backward = True  # its backward reads these parameters (even frozen ones)
        if u.tracked_views:  # a unit used twice keeps its first views: one gradient sum
            return
        track = grad and any(g.trainable for g in u.groups)
        for g in u.groups:
            with torch.set_grad_enabled(track and g.trainable):
                for e, piece in zip(g.entries, torch.split(g.full, g.sizes)):
                    view = piece.view(e.shape)
                    if track and g.trainable:  # see [Note: freeing a unit before its flat gradient exists]
                        view.register_hook(_hooks.weak_hook(self._group_grads_computed, g))
                    for m, attr in e.bindings:
                        setattr(m, attr, view)
        if track:
            u.tracked_views = True
            u.grads_due = u.splits_due = sum(g.trainable for g in u.groups)

    def _arm_inputs(self, u: FlatUnit, args: tuple, kwargs: dict) -> None:
        """For a unit with frozen groups: a hook that fires once the gradients of the unit's
        inputs are complete (see [Note: when a unit with frozen parameters is done])."""
        if not (u.has_frozen and torch.is_grad_enabled()):
            return
        if _hooks.hook_input_grads(args, kwargs, lambda _grads, u=u: self._inputs_done(u)):
            u.input_hooks += 1
            u.inputs_due += 1

    # -- forward hooks --------------------------------------------------------------------------
    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _hooks.cast_floating(args, self.param_dtype), _hooks.cast_floating(kwargs, self.param_dtype)

    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if _hooks.in_backward():
            return None
        if not any(u.needs_backward for u in self.flat_units):
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
        if _hooks.in_backward():  # activation-checkpointing recompute: just make sure we are gathered
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
        if not u.needs_backward:
            return
        if u.state is UnitState.SHARDED:
            self._start_gather(u, async_op=True)
        if self.prefetch and not u.is_root:
            order = self._forward_order
            i = len(order) - 1 - order[::-1].index(u) if u in order else -1
            for prev in reversed(order[:max(i, 0)]):
                if prev is not u and prev.needs_backward:
                    self._start_gather(prev, async_op=True)
                    break
        self._wait_gather(u)

    # [Note: when a unit with frozen parameters is done]
    # A unit may be freed once no backward node needs its gathered values any more. For a
    # trainable group that moment is its gradient's arrival: every node that read one of its
    # parameters has that parameter as a differentiable input, so it runs before the
    # parameter's AccumulateGrad. A frozen parameter gives no such signal, and the nodes that
    # read it (a frozen LayerNorm computing its input's gradient) may well run after the
    # unit's trainable gradients have arrived: freeing then is the "storage of size 0" crash.
    # What does follow every node of a unit is the gradient of its inputs: so a unit with
    # frozen groups waits for its trainable gradients *and* for a hook on the gradients of
    # its inputs (all of them: register_multi_grad_hook, mode "all"), armed at each forward
    # call. A unit whose inputs need no gradient (the first block after a frozen embedding;
    # the root, which takes token ids) has no such signal and is freed at the end of backward,
    # as a prefetched unit whose backward never came. Reduce-scatters never wait for this:
    # each trainable group's starts as soon as its gradient is final.

    # [Note: freeing a unit before its flat gradient exists]
    # The views of a group are the outputs of one SplitBackward node, and a hook on a
    # non-leaf tensor runs as that node is about to execute: once the gradients of all the
    # group's parameters are computed, i.e. once every node that read them has run (each
    # such node has the parameter as a differentiable input; frozen ones are the exception,
    # hence units with frozen groups wait as the Note above says). SplitBackward then
    # allocates the flat gradient (a unit's worth of bytes) while the per-parameter
    # gradients still exist. Freeing the gathered parameters in the hook, before that
    # allocation, takes one unit off the backward peak (measured on gpt2-small at N=4:
    # 27 MiB of 457). The hooks of one node all fire together; the first does the work.

    def _group_grads_computed(self, g: FlatGroup, _grad: torch.Tensor | None = None) -> None:
        if g.grads_computed:
            return
        g.grads_computed = True
        u = g.unit
        u.splits_due -= 1
        if u.splits_due == 0 and not u.has_frozen:
            self._reshard(u)

    def _unit_backward_done(self, u: FlatUnit) -> bool:
        if u.grads_due > 0:
            return False
        return not u.has_frozen or (u.input_hooks > 0 and u.inputs_due == 0)

    def _finish_unit(self, u: FlatUnit) -> None:
        u.needs_backward = u.tracked_views = False
        u.grads_due = u.splits_due = u.input_hooks = u.inputs_due = 0
        for g in u.groups:
            g.grads_computed = False
        self._reshard(u)

    def _inputs_done(self, u: FlatUnit) -> None:
        self._backward_end.arm()
        u.inputs_due = max(0, u.inputs_due - 1)
        if u.needs_backward and self._unit_backward_done(u):
            self._finish_unit(u)

    def _post_backward(self, g: FlatGroup, _full: torch.Tensor | None = None) -> None:
        self._backward_end.arm()
        u = g.unit
        full_grad = g.full.grad
        g.full.grad = None
        u.grads_due = max(0, u.grads_due - 1)
        if self._unit_backward_done(u):
            self._finish_unit(u)
        if full_grad is None:
            return
        if not self.sync_grads:
            # [no_sync] keep the whole local gradient (ours alone: autograd handed it over); reduce
            # the sum on the next synced backward.
            g.unsynced.keep(full_grad, g.shard.dtype, copy=False)
            return
        full_grad = g.unsynced.take(full_grad)
        reduce_dtype = self.reduce_dtype or g.shard.dtype
        full_grad = full_grad.to(reduce_dtype)
        out = torch.empty(g.shard.numel(), dtype=reduce_dtype, device=self.device)
        handle = collectives.reduce_scatter_into(out, full_grad, self.shard_group, average=True, async_op=True,
                                                 counter=self.counter)
        self._pending_reduces.append((g, out, full_grad, handle))
        while len({id(p[0].unit) for p in self._pending_reduces}) > MAX_UNITS_REDUCING:
            self._complete_oldest_reduce()

    # [Note: how many reduce-scatters may be in flight] (zero3's choice beside it: [Note: how many
    # reductions may be in flight], engines/api.py)
    # A reduce-scatter's input is the unit's whole unsharded gradient (4 bytes per parameter
    # in fp32, not divided by N), and it must stay alive until the collective completes.
    # Keeping every one until the end of backward would hold the whole model's gradient at
    # once, at every N: the peak would not fall with N (measured: 1.3 GiB against FSDP2's
    # 0.74 GiB per rank for gpt2-small at N=2). So the gradients of at most MAX_UNITS_REDUCING
    # units are in flight: when another unit's would make one more, the oldest reduce-scatter
    # is waited for and its input freed. One is enough to overlap: a unit's reduce-scatter
    # runs while the next unit's backward computes, and is waited for when that unit's
    # gradient arrives (FSDP2 likewise waits for the previous reduce-scatter at each
    # post-backward). Two held three units' gradients at the peak (797 against 770 MiB on
    # gpt2-small at N=2). Units are counted, not bytes: a byte cap set by the largest unit
    # (the embedding) would let many small blocks pile up.

    @torch.no_grad()
    def _complete_oldest_reduce(self) -> None:
        """Wait for the oldest reduce-scatter in flight and free its input; then (HSDP) start the
        all-reduce of its averaged shard over the replica group, or add it into `shard.grad`."""
        g, out, _full_grad, handle = self._pending_reduces.pop(0)
        if handle is not None:
            handle.wait()
        if self.replica_group is not None:
            # averaged over the S ranks of the shard group, now over the R replicas: the mean over N
            ar = collectives.all_reduce(out, self.replica_group, average=True, async_op=True,
                                        counter=self.replica_counter)
            self._pending_all_reduces.append((g, out, ar))
            return
        self._accumulate_grad(g, out)

    def _accumulate_grad(self, g: FlatGroup, out: torch.Tensor) -> None:
        """Add a fully reduced shard gradient into `shard.grad` (on the host with offload: added
        at the end of backward, once the copies have landed)."""
        if self._host_grads is not None:
            self._host_grads.copy(g.shard, out)
        else:
            _hooks.accumulate_grad_(g.shard, out)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        while self._pending_reduces:
            self._complete_oldest_reduce()
        for g, out, handle in self._pending_all_reduces:  # in launch order, the same on every rank
            if handle is not None:
                handle.wait()
            self._accumulate_grad(g, out)
        self._pending_all_reduces.clear()
        if self._host_grads is not None:
            self._host_grads.flush()
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
            lo = self.shard_rank * g.shard.numel()
            g.shard.zero_()
            for e in g.entries:
                flat = state[e.name].reshape(-1)
                a, b = max(lo, e.offset), min(lo + g.shard.numel(), e.offset + e.numel)
                if a < b:
                    g.shard[a - lo:b - lo].copy_(flat[a - e.offset:b - e.offset])
        self.state_keys.load_buffers(state)

    def shard_layout(self) -> list[tuple[nn.Parameter, list[ShardPiece]]]:
        """Every group's shard, frozen ones included (a checkpoint must hold every parameter).
        Under HSDP the R replicas of a shard describe the same pieces: DCP writes one of them."""
        layout = []
        for g in self.groups:
            n = g.shard.numel()
            lo = self.shard_rank * n
            pieces = []
            for e in g.entries:
                a, b = max(lo, e.offset), min(lo + n, e.offset + e.numel)
                if a < b:
                    pieces.append(ShardPiece(e.name, e.shape, a - e.offset, a - lo, b - a))
            layout.append((g.shard, pieces))
        return layout

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
        gradients reduce-scattered once per step within the shard group ([Note: hybrid sharding])."""
        group = options.get("shard_size") or model.world
        return gathered_unit_traffic(model, "all_gather", "reduce_scatter", group, root_kept=True)

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
