"""`fsdp-minimal`: fully sharded data parallelism in its plainest form. Read it before
engines/fsdp.py.

The algorithm
-------------
Units. The model is cut into units (its repeated blocks by default) and the root, which holds
everything outside them. A parameter belongs to the unit whose modules bind it (one bound in
several units, to the root, which is gathered whenever any unit runs).

Flat shards. A unit's parameters are laid end to end in one flat buffer per (requires_grad,
dtype), padded with zeros to a multiple of N; rank r keeps elements [r*S, (r+1)*S), S =
padded/N, as an ordinary `nn.Parameter`, its shard. The original parameters leave the modules
(a shape-only meta tensor stands in), so `parameters()` and any optimizer built on it hold 1/N
of everything. A frozen group's shard has requires_grad=False: gathered, never reduced.

Around each unit, from hooks, with the model's code unchanged:

    before its forward   all-gather the shards into the group's full buffer and point each
                         module's attribute (`weight`, ...) at its view of that buffer
    after its forward    free the buffer's storage; autograd's saved views keep their shape
                         and see the values again once it is refilled
    before its backward  (a hook on the outputs' gradient) all-gather again into it
    after its backward   the buffer is an autograd leaf: its gradient (every view's summed,
                         zeros for the padding) is reduce-scattered (averaged) into
                         `shard.grad`, and the unit is freed
    end of backward      whatever is still gathered is freed

Inside `no_sync()` nothing is reduce-scattered: each rank sums the whole flat gradient into an
accumulator of its own, reduce-scattered with the next synchronized backward.

[Note: what the minimal fsdp leaves to the full one]
Every collective here is waited for at once: easy to follow, memory bounded by the units being
computed, but no communication overlaps computation. engines/fsdp.py prefetches the next
unit's all-gather while the current one computes, keeps the root gathered from forward to
backward, reduce-scatters asynchronously (one unit in flight), frees a unit holding frozen
parameters once its inputs' gradients are in (here: at the end of backward), materializes one
unit at a time (here each rank builds the whole model, then keeps its slices), puts a
parameter tied across units in their innermost common unit, and adds hybrid sharding (HSDP),
mixed precision, CPU offload and keeping units gathered from forward to backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from shardlab.engines import collectives as C
from shardlab.engines.api import Engine, ShardPiece, materialize_whole_
from shardlab.engines.measuring import Measurable, MemoryTracking
from shardlab.engines.planning import Collective, LocalTensor, ModelTraffic, Plannable, gathered_unit_traffic
from shardlab.engines.state_keys import StateDictMirror
from shardlab.models.init import canonical_names, parameter_bindings


def weak_hook(method: Any, *args: Any) -> Any:
    """A hook calling `method(*args, *hook_args)` that keeps neither the method's object nor `args`
    alive: a hook on a tensor is held from C++, where the garbage collector cannot see the cycle it
    closes (full buffer -> hook -> group -> full buffer, and the engine with it). Once any of them is
    gone the hook does nothing."""
    refs = [weakref.WeakMethod(method), *(weakref.ref(a) for a in args)]

    def hook(*hook_args: Any) -> None:
        alive = [r() for r in refs]
        if all(x is not None for x in alive):
            alive[0](*alive[1:], *hook_args)

    return hook


@dataclass(eq=False)
class FlatEntry:
    """One original parameter inside a group's flat buffer."""

    name: str                                    # canonical name
    shape: torch.Size
    offset: int                                  # first element in the flat buffer
    numel: int
    bindings: list[tuple[nn.Module, str]]        # every (module, attribute) that refers to it


@dataclass(eq=False)
class Group:
    """A unit's parameters of one requires_grad and dtype, as one flat buffer sharded N ways."""

    unit: Unit
    entries: list[FlatEntry]                     # each original parameter: name, shape, offset, numel, bindings
    stand_ins: list[torch.Tensor]                # per entry, a meta tensor of its shape: what modules hold while sharded
    shard: nn.Parameter                          # this rank's slice: what the optimizer sees
    full: torch.Tensor                           # the whole flat buffer; storage freed while sharded
    views: list[torch.Tensor] = field(default_factory=list)   # per entry, made at each forward
    unsynced: torch.Tensor | None = None         # this rank's flat gradient summed inside no_sync


@dataclass(eq=False)
class Unit:
    module: nn.Module
    groups: list[Group] = field(default_factory=list)
    arrived: int = 0                             # groups whose gradient came in this backward


class MinimalFSDPEngine(Engine, Plannable, Measurable):
    grads_sharded = True

    def __init__(self, module: nn.Module, **kw: Any):
        super().__init__(module, **kw)
        self.counter = C.CommCounter()  # every collective below counts its bytes (shardlab bench)
        materialize_whole_(module, self.device)  # a meta model gets its values as a direct build would
        for t in {id(t): t for t in [*module.parameters(), *module.buffers()]}.values():  # tied: once
            C.broadcast(t.data, 0, self.group, counter=self.counter)  # every rank starts from rank 0's values
        names = canonical_names(module)
        # the state_dict's keys (tied names, buffers), recorded before any parameter leaves
        self.state_keys = StateDictMirror(module, lambda p: names[id(p)])
        self.unit_list = self._make_units(module, names)
        self.groups = [g for u in self.unit_list for g in u.groups]
        self._end_queued = False  # _finish_backward is queued to run at the end of this backward
        for unit in self.unit_list:
            unit.module.register_forward_pre_hook(partial(self._pre_forward, unit))
            unit.module.register_forward_hook(partial(self._post_forward, unit))

    # -- building the flat shards ---------------------------------------------------------------
    def _make_units(self, root: nn.Module, names: dict[int, str]) -> list[Unit]:
        modules = [root, *self.units]
        unit_of: dict[int, int] = {}
        for i, m in enumerate(modules):  # units come in module order: an inner unit overrides the outer
            unit_of.update({id(sub): i for sub in m.modules()})
        members: list[dict[tuple[bool, torch.dtype], list[nn.Parameter]]] = [{} for _ in modules]
        places = parameter_bindings(root)
        for p in {id(p): p for p in root.parameters()}.values():
            homes = {unit_of[id(m)] for m, _ in places[id(p)]}
            home = homes.pop() if len(homes) == 1 else 0  # bound in several units: the root's
            members[home].setdefault((p.requires_grad, p.dtype), []).append(p)
        units = []
        for m, groups in zip(modules, members):
            unit = Unit(m)
            for i, params in enumerate(groups.values()):
                unit.groups.append(self._make_group(unit, f"flat_shard_{i}", params, names, places))
            if unit.groups:
                units.append(unit)
        return units

    @torch.no_grad()
    def _make_group(self, unit: Unit, shard_name: str, params: list[nn.Parameter], names: dict[int, str],
                    places: dict[int, list[tuple[nn.Module, str]]]) -> Group:
        entries, offset = [], 0
        for p in params:
            entries.append(FlatEntry(names[id(p)], p.shape, offset, p.numel(), places[id(p)]))
            offset += p.numel()
        padded = -(-offset // self.world_size) * self.world_size
        flat = self._flat(entries, {e.name: p for e, p in zip(entries, params)}, padded)
        shard = nn.Parameter(flat.chunk(self.world_size)[self.rank].clone(), requires_grad=params[0].requires_grad)
        unit.module.register_parameter(shard_name, shard)
        stand_ins = [torch.empty_like(p, device="meta") for p in params]
        for e, stand_in in zip(entries, stand_ins):  # the original parameters leave; stand-ins keep their place
            for m, attr in e.bindings:
                del m._parameters[attr]
                m.__dict__[attr] = stand_in
        full = torch.empty(padded, dtype=shard.dtype, device=self.device, requires_grad=shard.requires_grad)
        full.untyped_storage().resize_(0)
        group = Group(unit, entries, stand_ins, shard, full)
        if shard.requires_grad:
            full.register_post_accumulate_grad_hook(weak_hook(self._post_backward, group))
        return group

    def _flat(self, entries: list[FlatEntry], values: Mapping[str, torch.Tensor], padded: int) -> torch.Tensor:
        """The entries' values laid end to end, zeros after them up to `padded` elements."""
        flat = [values[e.name].reshape(-1).to(self.device) for e in entries]
        return torch.cat([*flat, flat[0].new_zeros(padded - sum(e.numel for e in entries))])

    # -- gather, bind, free ---------------------------------------------------------------------
    @torch.no_grad()
    def _gather(self, unit: Unit) -> None:
        """All-gather every group that is not gathered. Writes go through `.data`: autograd saved
        views of `full`, and a write through `full` itself would bump the version counter those
        views are checked against in backward."""
        for g in unit.groups:
            storage = g.full.untyped_storage()
            if storage.size() == 0:
                storage.resize_(g.full.numel() * g.full.element_size())
                C.all_gather_into(g.full.data, g.shard.detach(), self.group, counter=self.counter)

    def _bind(self, unit: Unit) -> None:
        """The modules see the views: an entry in a module's `__dict__` is found before
        `nn.Module.__getattr__` would look anywhere else."""
        for g in unit.groups:
            for e, view in zip(g.entries, g.views):
                for m, attr in e.bindings:
                    m.__dict__[attr] = view

    def _reshard(self, unit: Unit) -> None:
        """Free the storage; the modules see their stand-ins again."""
        for g in unit.groups:
            g.full.untyped_storage().resize_(0)
            for e, stand_in in zip(g.entries, g.stand_ins):
                for m, attr in e.bindings:
                    m.__dict__[attr] = stand_in

    # -- forward and backward -------------------------------------------------------------------
    def _pre_forward(self, unit: Unit, module: nn.Module, args: tuple) -> None:
        self._gather(unit)
        for g in unit.groups:
            # views of a leaf that requires grad: autograd sums their gradients (zeros for the
            # padding, the last piece, which no entry takes) into `full.grad`
            sizes = [e.numel for e in g.entries]
            pieces = g.full.split([*sizes, g.full.numel() - sum(sizes)])
            g.views = [v.view(e.shape) for v, e in zip(pieces, g.entries)]
        self._bind(unit)

    def _post_forward(self, unit: Unit, module: nn.Module, args: tuple, output: Any) -> None:
        self._reshard(unit)
        for x in tree_flatten(output)[0]:  # x's hook fires when its gradient is complete, before any
            if isinstance(x, torch.Tensor) and x.requires_grad:  # backward node of the unit runs
                x.register_hook(partial(self._pre_backward, unit))

    def _pre_backward(self, unit: Unit, _grad: torch.Tensor) -> None:
        if not self._end_queued:  # the first of this backward: autograd calls _finish_backward after its last node
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._gather(unit)  # a no-op when another output of the unit got here first
        self._bind(unit)    # an activation-checkpoint recompute reads the modules' attributes

    @torch.no_grad()
    def _post_backward(self, g: Group, full: torch.Tensor) -> None:
        grad, full.grad = full.grad, None  # ours alone: autograd handed it over
        if not self.sync_grads:
            g.unsynced = grad if g.unsynced is None else g.unsynced.add_(grad)
        else:
            if g.unsynced is not None:
                grad, g.unsynced = grad.add_(g.unsynced), None
            out = torch.empty_like(g.shard)
            # averaged, never summed: [Note: why average] (engines/api.py)
            C.reduce_scatter_into(out, grad, self.group, average=True, counter=self.counter)
            g.shard.grad = out if g.shard.grad is None else g.shard.grad.add_(out)
        g.unit.arrived += 1
        # A frozen group never arrives, and a node reading it may still run (a frozen LayerNorm
        # computing its input's gradient): a unit holding one is freed at the end of backward.
        if g.unit.arrived == len(g.unit.groups):
            self._reshard(g.unit)

    def _finish_backward(self) -> None:
        self._end_queued = False
        for unit in self.unit_list:
            self._reshard(unit)
            unit.arrived = 0

    # -- the rest of the training contract ------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        params = {}
        for g in self.groups:
            flat = torch.empty(g.full.numel(), dtype=g.shard.dtype, device=self.device)
            C.all_gather_into(flat, g.shard.detach(), self.group, counter=self.counter)
            for e in g.entries:
                params[e.name] = flat[e.offset:e.offset + e.numel].view(e.shape).to("cpu", copy=True)
        return self.state_keys.full(params)

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for g in self.groups:
            g.shard.copy_(self._flat(g.entries, state, g.full.numel()).chunk(self.world_size)[self.rank])
        self.state_keys.load_buffers(state)

    def shard_layout(self) -> list[tuple[nn.Parameter, list[ShardPiece]]]:
        """Each shard holds the parts of its group's entries that fall in its slice [r*S, (r+1)*S):
        one piece per entry overlapping it (none for an entry wholly in another rank's slice)."""
        layout = []
        for g in self.groups:
            start, end, pieces = self.rank * g.shard.numel(), (self.rank + 1) * g.shard.numel(), []
            for e in g.entries:
                lo, hi = max(start, e.offset), min(end, e.offset + e.numel)
                if lo < hi:  # (name, shape, first element in the parameter, in the shard, how many)
                    pieces.append(ShardPiece(e.name, e.shape, lo - e.offset, lo - start, hi - lo))
            layout.append((g.shard, pieces))
        return layout

    # -- what plan and the measurements ask (engines/planning.py, engines/measuring.py) ----------
    @classmethod
    def planned_state(cls, params: list[nn.Parameter], world: int, options: Mapping[str, Any]
                      ) -> list[list[LocalTensor]] | None:
        """Flat groups per unit, padded: plan builds the engine and asks `rank_states`."""
        return None

    @classmethod
    def planned_ranks(cls, world: int) -> list[int]:
        """Padding only shrinks the last rank's slice: the first and the last tell."""
        return sorted({0, world - 1})

    def hook_memory_tracker(self, tracker: MemoryTracking) -> None:
        for g in self.groups:  # each group's flat buffer is one leaf for the whole step
            tracker.hook_incoming(g.full, "unsharded_grads")

    @classmethod
    def step_traffic(cls, model: ModelTraffic, options: Mapping[str, Any]) -> list[Collective]:
        """Every unit, the root too, all-gathered in forward and again in backward at every micro
        batch; gradients reduce-scattered once per step."""
        return gathered_unit_traffic(model, "all_gather", "reduce_scatter", model.world, root_kept=False)

    def memory_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for g in self.groups:
            yield "gathered_params", g.full  # zero bytes while sharded
            if g.unsynced is not None:
                yield "unsharded_grads", g.unsynced

    def comm_counters(self) -> list[C.CommCounter]:
        return [self.counter]
