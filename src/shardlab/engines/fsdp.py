"""FSDP from scratch: every parameter, gradient and optimizer state is sliced across ranks.

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

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardlab.engines import _hooks, collectives
from shardlab.engines.api import CPUOffload, Engine, MixedPrecision, ShardPiece, is_meta
from shardlab.models.init import RANGE_READERS_ATTR, canonical_names, init_parameters_


class UnitState(enum.Enum):
    """Where a unit's full buffers are: freed, being all-gathered (async), or usable."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


MAX_UNITS_REDUCING = 1  # see [Note: how many reduce-scatters may be in flight]


@dataclass(eq=False)
class FlatEntry:
    """One original parameter inside a group's flat buffer."""

    name: str                              # canonical name (first in named_parameters)
    shape: torch.Size
    offset: int                            # first element in the flat buffer
    numel: int
    bindings: list[tuple[nn.Module, str]]  # every (module, attribute) that refers to it


@dataclass(eq=False)
class FlatGroup:
    """Parameters of one unit that share requires_grad and dtype, as one sharded flat buffer."""

    unit: FlatUnit
    entries: list[FlatEntry]
    shard: nn.Parameter                    # this rank's slice, in the parameters' dtype: what the optimizer sees
    full: torch.Tensor                     # gathered buffer (leaf, compute dtype), storage freed when sharded
    full_data: torch.Tensor                # full.data: same storage, own version counter
    sizes: list[int]                       # split sizes: entries, then padding
    handle: Any = None                     # in-flight all-gather
    send: torch.Tensor | None = None       # kept alive while the all-gather runs
    unsharded_grad: torch.Tensor | None = None  # no_sync accumulation (full size, the shard's dtype)
    grads_computed: bool = False           # its parameters' gradients are all in (SplitBackward is next)

    @property
    def trainable(self) -> bool:
        return self.shard.requires_grad


@dataclass(eq=False)
class FlatUnit:
    """A wrap unit (or the root's remaining parameters): its groups are gathered, used and freed
    together. One group per (requires_grad, dtype) found in it, trainable groups first."""

    module: nn.Module
    is_root: bool
    groups: list[FlatGroup] = field(default_factory=list)
    state: UnitState = UnitState.SHARDED
    tracked_views: bool = False            # autograd-connected views installed for this step
    needs_backward: bool = False           # ran forward with grad; its post-backward is due
    grads_due: int = 0                     # trainable groups whose gradient has not arrived yet
    splits_due: int = 0                    # trainable groups whose SplitBackward has not started yet
    input_hooks: int = 0                   # input-gradient hooks armed this step (units with frozen groups)
    inputs_due: int = 0                    # ... of which not fired yet

    @property
    def has_frozen(self) -> bool:
        return any(not g.trainable for g in self.groups)


class FSDPEngine(Engine):
    strategy = "fsdp"
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
        self.host_grads: list[tuple[FlatGroup, torch.Tensor]] = []  # offload: reduced gradients copied to the host
        self.pending_all_reduces: list[tuple[FlatGroup, torch.Tensor, Any]] = []  # HSDP: (group, shard grad, handle)
        mp = MixedPrecision.parse(mixed_precision) or MixedPrecision()
        # None: each group computes and communicates in its parameters' own dtype.
        self.param_dtype = mp.param_dtype
        self.reduce_dtype = mp.reduce_dtype or mp.param_dtype
        self.counter = collectives.CommCounter()
        self.sync_grads = True
        self.backward_end = _hooks.BackwardEnd(self._finish_backward)
        # reduce-scatters in flight, oldest first: (group, output shard, input full gradient, handle)
        self.pending_reduces: list[tuple[FlatGroup, torch.Tensor, torch.Tensor, Any]] = []
        self.forward_order: list[FlatUnit] = []
        self._build_groups(module)
        self._install_hooks()

    # -- construction ---------------------------------------------------------------------------
    def _build_groups(self, root: nn.Module) -> None:
        names = canonical_names(root)
        seed = getattr(root, "init_seed", 0)
        meta = is_meta(root)
        self.state_keys = _hooks.StateDictMirror(root, lambda p: names[id(p)])

        # Group tree: the root, then the units; each module belongs to the innermost unit.
        owners = [root, *self.units]
        unit_ids = {id(u) for u in self.units}
        group_of_module: dict[int, int] = {}
        parent: dict[int, int | None] = {0: None}
        for gi, owner in enumerate(owners):
            stack, seen = [owner], set()
            while stack:
                m = stack.pop()
                if id(m) in seen:
                    continue
                seen.add(id(m))
                if m is not owner and id(m) in unit_ids:
                    parent[owners.index(m)] = gi
                    continue
                group_of_module[id(m)] = gi
                stack.extend(m.children())

        def ancestry(gi: int) -> list[int]:
            path = [gi]
            while parent.get(path[-1]) is not None:
                path.append(parent[path[-1]])
            return path[::-1]

        # Parameters by id, with all their bindings; a tied parameter goes to the innermost
        # unit that contains all of its bindings (so that unit is gathered at every use).
        bindings: dict[int, list[tuple[nn.Module, str]]] = {}
        tensors: dict[int, nn.Parameter] = {}
        for m in root.modules():
            for attr, p in m._parameters.items():
                if p is not None:
                    bindings.setdefault(id(p), []).append((m, attr))
                    tensors[id(p)] = p
        members: list[list[int]] = [[] for _ in owners]
        order = {pid: i for i, pid in enumerate(names)}
        for pid in sorted(bindings, key=order.__getitem__):
            paths = [ancestry(group_of_module[id(m)]) for m, _ in bindings[pid]]
            common = 0
            for level in zip(*paths):
                if len(set(level)) > 1:
                    break
                common = level[0]
            members[common].append(pid)

        self.flat_units: list[FlatUnit] = []
        self.groups: list[FlatGroup] = []
        materialized: dict[int, str] = dict(names)
        range_readers = getattr(root, RANGE_READERS_ATTR, None) if meta else None
        readers: dict[int, Any] = {}  # pid -> read(start, end): left on meta, only our range is read
        for gi, owner in enumerate(owners):
            pids = members[gi]
            region = [m for m in owner.modules() if group_of_module.get(id(m)) == gi]
            if meta:
                # Materialize this unit only: its parameters and its modules' buffers. Parameters
                # the model reads by range (pretrained weights) stay meta: _make_group reads the
                # range this rank keeps (see [Note: reading a flat range by rows] in models/hf.py).
                if range_readers is not None:
                    readers.update(range_readers([tensors[pid] for pid in pids], names))
                for pid in pids:
                    if pid in readers:
                        continue
                    p = tensors[pid]
                    new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                       p.requires_grad)
                    materialized[id(new)] = names[pid]
                    for m, attr in bindings[pid]:
                        m._parameters[attr] = new
                    tensors[pid] = new
                for m in region:
                    for bname, b in m._buffers.items():
                        if b is not None and b.device.type == "meta":
                            m._buffers[bname] = torch.empty_like(b, device=self.device)
                init_modules = region + [m for pid in pids for m, _ in bindings[pid]]
                init_parameters_(root, seed, modules=init_modules, names=materialized)
            else:
                for m in region:
                    for bname, b in m._buffers.items():
                        if b is not None:
                            m._buffers[bname] = b.to(self.device)
            if pids:
                unit = FlatUnit(owner, gi == 0)
                # [Note: frozen and trainable parameters in one unit]
                # One flat group per (requires_grad, dtype): a shard is one Parameter, so it is
                # either trained or not, and holds one dtype. Frozen groups are gathered and
                # freed with the unit's trainable ones, but their shard has requires_grad=False
                # (torch optimizers and clip_grad_norm_ skip it: it never has a .grad), their
                # full buffer is no autograd leaf, and nothing of theirs is reduce-scattered.
                keys: dict[tuple[bool, torch.dtype], list[int]] = {}
                for pid in pids:
                    keys.setdefault((tensors[pid].requires_grad, tensors[pid].dtype), []).append(pid)
                first_dtype = tensors[pids[0]].dtype
                for (trainable, dtype), group_pids in sorted(keys.items(), key=lambda kv: not kv[0][0]):
                    name = "flat_shard" + ("" if trainable else "_frozen")
                    name += "" if dtype == first_dtype else "_" + str(dtype).removeprefix("torch.")
                    params = [(names[pid], tensors.pop(pid), bindings[pid], readers.pop(pid, None))
                              for pid in group_pids]
                    unit.groups.append(self._make_group(unit, params, name))
                    del params  # the full tensors die here: one unit materialized at a time
                self.flat_units.append(unit)
                self.groups.extend(unit.groups)
        # Buffers stay whole on every rank; rank 0's values win (as in DDP).
        _hooks.broadcast_from_rank0(root.buffers(), self.group, self.counter)
        first = self.flat_units[0] if self.flat_units else None
        self.root_unit: FlatUnit | None = first if first is not None and first.is_root else None
        self.wrap_units = [u for u in self.flat_units if not u.is_root]
        self.unit_index = {id(u): i for i, u in enumerate(self.wrap_units)}

    def _compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.param_dtype if self.param_dtype is not None and dtype.is_floating_point else dtype

    @torch.no_grad()
    def _make_group(self, unit: FlatUnit, params: list, shard_name: str) -> FlatGroup:
        """Flatten `params` (name, full tensor, bindings, range reader or None), all of one
        requires_grad and dtype, keep this rank's slice, drop the rest. A parameter with a range
        reader is a meta tensor: only the elements of this rank's slice are read."""
        dtype, trainable = params[0][1].dtype, params[0][1].requires_grad
        entries, offset = [], 0
        for name, p, binds, _read in params:
            entries.append(FlatEntry(name, p.shape, offset, p.numel(), binds))
            offset += p.numel()
        padded = -(-offset // self.shard_size) * self.shard_size
        shard_numel = padded // self.shard_size
        lo = self.shard_rank * shard_numel
        if self.offload is not None:
            shard = self.offload.host_tensor(params[0][1], shard_numel).zero_()
        else:
            shard = torch.zeros(shard_numel, dtype=dtype, device=self.device)
        for e, (_, p, _, read) in zip(entries, params):
            a, b = max(lo, e.offset), min(lo + shard_numel, e.offset + e.numel)
            if a < b:
                value = read(a - e.offset, b - e.offset) if read is not None else p.detach().reshape(-1)[a - e.offset:b - e.offset]
                shard[a - lo:b - lo].copy_(value)
        for e in entries:  # the full tensors are freed here: no attribute refers to them now
            for m, attr in e.bindings:
                del m._parameters[attr]
        shard_param = nn.Parameter(shard, requires_grad=trainable)
        unit.module.register_parameter(shard_name, shard_param)
        compute_dtype = self._compute_dtype(dtype)
        full = torch.empty(padded, dtype=compute_dtype, device=self.device)
        full.requires_grad_(trainable)
        full.untyped_storage().resize_(0)
        group = FlatGroup(unit, entries, shard_param, full, full.data, [e.numel for e in entries] + [padded - offset])
        if trainable:
            full.register_post_accumulate_grad_hook(_hooks.weak_hook(self._post_backward, group))
        for e in entries:  # outside forward/backward the original names are shape-only placeholders
            for m, attr in e.bindings:
                setattr(m, attr, torch.empty(e.shape, dtype=compute_dtype, device="meta"))
        return group

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
            self.forward_order.clear()  # the last forward's backward is done (or never comes)
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
        i = self.unit_index[id(u)]
        nxt = self.wrap_units[i + 1] if i + 1 < len(self.wrap_units) else None
        self._gather_for_forward(u, nxt)
        if torch.is_grad_enabled():
            self.forward_order.append(u)
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
        self.backward_end.arm()
        if not u.needs_backward:
            return
        if u.state is UnitState.SHARDED:
            self._start_gather(u, async_op=True)
        if self.prefetch and not u.is_root:
            order = self.forward_order
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
        self.backward_end.arm()
        u.inputs_due = max(0, u.inputs_due - 1)
        if u.needs_backward and self._unit_backward_done(u):
            self._finish_unit(u)

    def _post_backward(self, g: FlatGroup, _full: torch.Tensor | None = None) -> None:
        self.backward_end.arm()
        u = g.unit
        full_grad = g.full.grad
        g.full.grad = None
        u.grads_due = max(0, u.grads_due - 1)
        if self._unit_backward_done(u):
            self._finish_unit(u)
        if full_grad is None:
            return
        if not self.sync_grads:
            # [no_sync] keep the whole local gradient; reduce the sum on the next synced backward.
            if g.unsharded_grad is None:
                g.unsharded_grad = full_grad.to(g.shard.dtype)  # ours alone: autograd handed it over
            else:
                g.unsharded_grad.add_(full_grad)
            return
        if g.unsharded_grad is not None:
            full_grad = g.unsharded_grad.add_(full_grad)
            g.unsharded_grad = None
        reduce_dtype = self.reduce_dtype or g.shard.dtype
        full_grad = full_grad.to(reduce_dtype)
        out = torch.empty(g.shard.numel(), dtype=reduce_dtype, device=self.device)
        handle = collectives.reduce_scatter_into(out, full_grad, self.shard_group, average=True, async_op=True,
                                                 counter=self.counter)
        self.pending_reduces.append((g, out, full_grad, handle))
        while len({id(p[0].unit) for p in self.pending_reduces}) > MAX_UNITS_REDUCING:
            self._complete_oldest_reduce()

    # [Note: how many reduce-scatters may be in flight]
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
        g, out, _full_grad, handle = self.pending_reduces.pop(0)
        if handle is not None:
            handle.wait()
        if self.replica_group is not None:
            # averaged over the S ranks of the shard group, now over the R replicas: the mean over N
            ar = collectives.all_reduce(out, self.replica_group, average=True, async_op=True,
                                        counter=self.replica_counter)
            self.pending_all_reduces.append((g, out, ar))
            return
        self._accumulate_grad(g, out)

    @torch.no_grad()
    def _accumulate_grad(self, g: FlatGroup, out: torch.Tensor) -> None:
        """Add a fully reduced shard gradient into `shard.grad` (on the host with offload)."""
        if self.offload is not None:
            # device-to-host, asynchronous into pinned memory; added at the end of backward,
            # once the stream is synchronized (see _finish_backward)
            host = self.offload.host_tensor(out)
            host.copy_(out, non_blocking=host.is_pinned())
            self.host_grads.append((g, host))
            return
        if g.shard.grad is None:
            g.shard.grad = out.to(g.shard.dtype)  # no copy when already in the shard's dtype
        else:
            g.shard.grad.add_(out)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        while self.pending_reduces:
            self._complete_oldest_reduce()
        for g, out, handle in self.pending_all_reduces:  # in launch order, the same on every rank
            if handle is not None:
                handle.wait()
            self._accumulate_grad(g, out)
        self.pending_all_reduces.clear()
        if self.host_grads:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the D2H copies have landed
            for g, host in self.host_grads:
                if g.shard.grad is None:
                    g.shard.grad = host.to(g.shard.dtype)
                else:
                    g.shard.grad.add_(host)
            self.host_grads.clear()
        for u in self.flat_units:  # units whose backward never came, or gave no signal (frozen)
            self._finish_unit(u)
        for g in self.groups:
            g.full.grad = None
        self.forward_order.clear()

    # -- the contract ---------------------------------------------------------------------------
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

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes per collective kind: all-gathers and reduce-scatters over the shard group (and
        the wrap-time broadcasts over the whole group), all-reduces over the replica group."""
        return {**self.counter.snapshot(), **self.replica_counter.snapshot()}

    def comm_seconds(self) -> dict[str, float]:
        """Seconds per kind; the two counters never share a kind (the replica group only all-reduces)."""
        return {**self.counter.seconds_snapshot(), **self.replica_counter.seconds_snapshot()}

    def comm_stats_by_group(self) -> dict[str, dict[str, dict[str, int]]]:
        """The same, split by the group each collective ran over: "shard" (also the wrap-time
        broadcast of buffers, over the whole group) and "replicate" (HSDP only)."""
        return {"shard": self.counter.snapshot(), "replicate": self.replica_counter.snapshot()}

    def gathered_bytes(self) -> int:
        """Bytes of gathered (full) parameter storage held right now, over all groups."""
        return sum(g.full_data.untyped_storage().nbytes() for g in self.groups)
