"""`zero3-minimal`: ZeRO stage 3 in its plainest form. Read it before engines/zero3.py.

The algorithm
-------------
Ownership. Every parameter tensor belongs whole to one rank: largest first, each onto the rank
owning the fewest bytes so far, trainable tensors before frozen ones (`assign_owners`, the full
engine's rule, written out below). A rank keeps only what it owns: the other parameters leave its modules (a
shape-only meta tensor stands in), so `parameters()` and any optimizer built on it hold about
1/N of the model.

Units. The model is cut into units (its repeated blocks by default) and the root, which holds
everything outside them; a unit's tensors are those its own modules bind. Around each unit,
from hooks, with the model's code unchanged:

    before its forward   each tensor is broadcast from its owner into a fresh full tensor,
                         which the unit's modules see in place of the parameter
    after its forward    the full tensors' storage is freed; autograd's saved views of them
                         keep their shape and see the values again once refilled
    before its backward  (a hook on the outputs' gradient) refilled: broadcast again
    each gradient        a full tensor's gradient is reduced (averaged) onto the owner, who
                         adds it to its `.grad`; when all are in, the unit's storage is freed
    end of backward      whatever is still gathered is freed

Each full tensor is an autograd leaf, so all uses of a tensor in one forward of a unit (GPT's
tied embedding and head) arrive as one gradient. Inside `no_sync()` nothing is reduced: each
rank sums every gradient into a whole-size accumulator, reduced with the next synced backward.

[Note: what the minimal zero3 leaves to the full one]
Each collective here carries one tensor and is waited for at once: easy to follow, memory
bounded by a unit, but no communication overlaps computation. engines/zero3.py sends one flat
buffer per owner and unit, reduces asynchronously under a cap on the bytes in flight, frees a
unit holding frozen parameters once its inputs' gradients are in (here: at the end of
backward), materializes only what a rank owns (here each rank builds the whole model, then
drops the rest), survives parameters used on some ranks only, and adds mixed precision, CPU
offload, retain_graph and keeping units gathered from forward to backward.
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
from shardlab.engines.planning import Collective, LocalTensor, ModelTraffic, Plannable
from shardlab.engines.state_keys import StateDictMirror
from shardlab.models.init import canonical_names


def assign_owners(params: list[nn.Parameter], world: int) -> list[int]:
    """Each tensor's owner: the trainable ones first, largest first, each onto the rank owning the
    fewest trainable bytes so far (they bring gradients and optimizer state: those are balanced);
    then the frozen ones, onto the rank owning the fewest bytes in all. Ties: the lowest rank."""
    size = [p.numel() * p.element_size() for p in params]
    owners, trainable_bytes, all_bytes = [0] * len(params), [0] * world, [0] * world
    for trainable, load in ((True, trainable_bytes), (False, all_bytes)):
        for i in sorted((i for i, p in enumerate(params) if p.requires_grad == trainable), key=lambda i: -size[i]):
            owners[i] = rank = min(range(world), key=lambda r: load[r])
            all_bytes[rank] += size[i]
            if trainable:
                trainable_bytes[rank] += size[i]
    return owners


def weak_hook(method: Any, *args: Any) -> Any:
    """A hook calling `method(*args, *hook_args)` that keeps neither the method's object nor `args`
    alive: a hook on a tensor is held from C++, where the garbage collector cannot see the cycle it
    closes (full tensor -> hook -> gather -> full tensor, and the engine with it). Once any of them is
    gone the hook does nothing."""
    refs = [weakref.WeakMethod(method), *(weakref.ref(a) for a in args)]

    def hook(*hook_args: Any) -> None:
        alive = [r() for r in refs]
        if all(x is not None for x in alive):
            alive[0](*alive[1:], *hook_args)

    return hook


@dataclass(eq=False)
class Owned:
    """One parameter tensor (tied names share one) and who owns it."""

    name: str                        # canonical name
    owner: int
    trainable: bool
    stand_in: torch.Tensor           # meta tensor of its shape and dtype: what non-owners' modules hold
    param: nn.Parameter | None       # the owner's Parameter; None on the other ranks
    unsynced: torch.Tensor | None = None   # this rank's gradient summed inside no_sync


@dataclass(eq=False)
class Unit:
    module: nn.Module
    tensors: list[Owned] = field(default_factory=list)
    places: list[tuple[nn.Module, str, int]] = field(default_factory=list)  # (module, attribute, index in tensors)
    bound: Gather | None = None      # the gather whose full tensors the modules see now


@dataclass(eq=False)
class Gather:
    """One forward run of a unit: its full tensors, from the forward until its backward is done."""

    unit: Unit
    fulls: list[torch.Tensor]
    waiting: int                     # trainable tensors whose gradient has not arrived in this backward


class MinimalZero3Engine(Engine, Plannable, Measurable):
    grads_sharded = True
    probe_whole_depth = True  # owners by size over the whole model, as zero3's: plan probes it whole

    def __init__(self, module: nn.Module, **kw: Any):
        super().__init__(module, **kw)
        self.counter = C.CommCounter()  # every collective below counts its bytes (shardlab bench)
        materialize_whole_(module, self.device)  # a meta model gets its values as a direct build would
        for x in {id(x): x for x in [*module.parameters(), *module.buffers()]}.values():  # tied: once
            C.broadcast(x.data, 0, self.group, counter=self.counter)  # every rank starts from rank 0's values
        params = list({id(p): p for p in module.parameters()}.values())
        names = canonical_names(module)
        owners = assign_owners(params, self.world_size)
        self.owned = [Owned(names[id(p)], o, p.requires_grad, torch.empty_like(p, device="meta"),
                            p if o == self.rank else None) for p, o in zip(params, owners)]
        by_id = {id(p): t for p, t in zip(params, self.owned)}
        # the state_dict's keys (tied names, buffers), recorded before any parameter leaves
        self.state_keys = StateDictMirror(module, lambda p: by_id[id(p)])
        self.unit_list = self._make_units(module, by_id)
        for unit in self.unit_list:
            for m, attr, i in unit.places:
                if unit.tensors[i].param is None:  # not ours: drop it, a stand-in keeps its shape
                    del m._parameters[attr]
                    m.__dict__[attr] = unit.tensors[i].stand_in
            unit.module.register_forward_pre_hook(partial(self._pre_forward, unit))
            unit.module.register_forward_hook(partial(self._post_forward, unit))
        self._live: list[Gather] = []  # gathers not yet released, oldest first
        self._end_queued = False  # _finish_backward is queued to run at the end of this backward
        self._memory_trackers: weakref.WeakSet = weakref.WeakSet()  # hook_memory_tracker's

    def _make_units(self, root: nn.Module, by_id: dict[int, Owned]) -> list[Unit]:
        modules = [root, *self.units]
        unit_of: dict[int, int] = {}
        for i, m in enumerate(modules):  # units come in module order: an inner unit overrides the outer
            unit_of.update({id(sub): i for sub in m.modules()})
        units = [Unit(m) for m in modules]
        for m in root.modules():
            unit = units[unit_of[id(m)]]
            for attr, p in m._parameters.items():
                if p is not None:
                    if by_id[id(p)] not in unit.tensors:
                        unit.tensors.append(by_id[id(p)])
                    unit.places.append((m, attr, unit.tensors.index(by_id[id(p)])))
        return [u for u in units if u.tensors]

    # -- gather, bind, free ---------------------------------------------------------------------
    @torch.no_grad()
    def _fill(self, gather: Gather) -> None:
        """Give the full tensors storage (again) and broadcast each from its owner. Writes go
        through `.data`: autograd saved views of these tensors, and a write through the tensor
        itself would bump the version counter those views are checked against in backward."""
        handles = []
        for t, full in zip(gather.unit.tensors, gather.fulls):
            full.untyped_storage().resize_(full.numel() * full.element_size())
            if t.param is not None:
                full.data.copy_(t.param)
            handles.append(C.broadcast(full.data, t.owner, self.group, async_op=True, counter=self.counter))
        for handle in handles:
            if handle is not None:  # None: one rank, nothing was sent
                handle.wait()

    def _bind(self, gather: Gather) -> None:
        """The unit's modules see the full tensors: an entry in a module's `__dict__` is found
        before `nn.Module.__getattr__` looks in `_parameters`, so `parameters()` and the
        optimizer keep seeing the owned Parameter."""
        for m, attr, i in gather.unit.places:
            m.__dict__[attr] = gather.fulls[i]
        gather.unit.bound = gather

    def _free(self, gather: Gather, done: bool = False) -> None:
        """Free the storage; the modules see their own Parameter (owner) or the stand-in again.
        done: nothing more will come for this gather (its backward is over, or will not come)."""
        if done and gather in self._live:
            self._live.remove(gather)
        for full in gather.fulls:
            full.untyped_storage().resize_(0)
        unit = gather.unit
        if unit.bound is gather:
            for m, attr, i in unit.places:
                if unit.tensors[i].param is None:
                    m.__dict__[attr] = unit.tensors[i].stand_in
                else:
                    m.__dict__.pop(attr, None)
            unit.bound = None

    # -- forward --------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit, module: nn.Module, args: tuple) -> None:
        fulls = [torch.empty_like(t.stand_in, device=self.device) for t in unit.tensors]
        gather = Gather(unit, fulls, waiting=0)
        self._fill(gather)
        if torch.is_grad_enabled():
            for t, full in zip(unit.tensors, fulls):
                if t.trainable:
                    full.requires_grad_(True)  # a leaf of its own: its gradient is this gather's
                    full.register_post_accumulate_grad_hook(weak_hook(self._on_gradient, gather, t))
                    gather.waiting += 1
        self._live.append(gather)
        self._bind(gather)

    def _post_forward(self, unit: Unit, module: nn.Module, args: tuple, output: Any) -> None:
        gather = unit.bound
        outputs = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor) and x.requires_grad]
        for x in outputs:  # fires when x's gradient is complete, before any backward node of the unit
            x.register_hook(partial(self._pre_backward, gather))
        self._free(gather, done=not outputs)  # no backward will come: evaluation, no_grad

    # -- backward -------------------------------------------------------------------------------
    def _pre_backward(self, gather: Gather, _grad: torch.Tensor) -> None:
        if gather.unit.bound is gather:
            return  # another output of the same forward got here first
        if not self._end_queued:  # the first of this backward: autograd calls _finish_backward after its last node
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._fill(gather)
        self._bind(gather)  # an activation-checkpoint recompute reads the modules' attributes

    @torch.no_grad()
    def _on_gradient(self, gather: Gather, t: Owned, full: torch.Tensor) -> None:
        grad, full.grad = full.grad, None  # ours alone: autograd handed it over
        if not self.sync_grads:
            t.unsynced = grad if t.unsynced is None else t.unsynced.add_(grad)
        else:
            if t.unsynced is not None:
                grad, t.unsynced = grad.add_(t.unsynced), None
            # averaged, never summed: [Note: why average] (engines/api.py)
            C.reduce(grad, t.owner, self.group, average=True, counter=self.counter)
            if t.param is not None:
                t.param.grad = grad if t.param.grad is None else t.param.grad.add_(grad)
        gather.waiting -= 1
        # A node reading a frozen tensor gives no gradient to wait for and may still run (a frozen
        # LayerNorm computing its input's gradient): a unit holding one waits for the end of backward.
        if gather.waiting == 0 and all(x.trainable for x in gather.unit.tensors):
            self._free(gather, done=True)

    def _finish_backward(self) -> None:
        self._end_queued = False
        for gather in list(self._live):
            self._free(gather, done=True)

    # -- the rest of the training contract ------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        full = {}
        for t in self.owned:  # the same order on every rank
            value = t.param.detach().clone() if t.param is not None else torch.empty_like(t.stand_in, device=self.device)
            C.broadcast(value, t.owner, self.group, counter=self.counter)
            full[t] = value.cpu()
        return self.state_keys.full(full)

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for k in self.state_keys.keys:
            if k.param is not None and k.param.param is not None:
                k.param.param.copy_(state[k.key])
        self.state_keys.load_buffers(state)

    def shard_layout(self) -> list[tuple[nn.Parameter, list[ShardPiece]]]:
        """Every owned Parameter is one whole original parameter."""
        return [(t.param, [ShardPiece(t.name, t.stand_in.shape, 0, 0, t.param.numel())])
                for t in self.owned if t.param is not None]

    # -- what plan and the measurements ask (engines/planning.py, engines/measuring.py) ----------
    @classmethod
    def planned_state(cls, params: list[nn.Parameter], world: int, options: Mapping[str, Any]
                      ) -> list[list[LocalTensor]] | None:
        """One rank owns everything; over several, plan builds the engine and asks `rank_states`."""
        return super().planned_state(params, world, options) if world == 1 else None

    def rank_states(self) -> list[list[LocalTensor]]:
        """Every rank's owned tensors: ownership is known on every rank."""
        return [[LocalTensor(t.stand_in.numel(), t.stand_in.element_size(), t.trainable)
                 for t in self.owned if t.owner == r] for r in range(self.world_size)]

    @classmethod
    def step_traffic(cls, model: ModelTraffic, options: Mapping[str, Any]) -> list[Collective]:
        """Every tensor broadcast in forward and again in backward at every micro batch; each
        trainable tensor's gradient reduced to its owner once per step; one tensor per call."""
        calls, trainable = max(1, model.tensors), max(1, model.trainable_tensors)
        return [Collective("broadcast", model.param_bytes / calls, 2 * calls * model.micro_batches, model.world),
                Collective("reduce", model.trainable_bytes / trainable, trainable, model.world)]

    def memory_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for gather in self._live:
            for full in gather.fulls:
                yield "gathered_params", full  # zero bytes while freed between forward and backward
        for t in self.owned:
            if t.unsynced is not None:
                yield "unsharded_grads", t.unsynced

    def hook_memory_tracker(self, tracker: MemoryTracking) -> None:
        """Each gather makes new leaves: a forward pre-hook on each unit, registered after the
        engine's (which gathered), lets the tracker claim their gradients. Once per tracker."""
        if tracker in self._memory_trackers:
            return
        self._memory_trackers.add(tracker)
        tracker_ref = weakref.ref(tracker)

        def after_gather(unit: Unit) -> None:
            t = tracker_ref()
            if t is not None and t.tracking and unit.bound is not None:
                for full in unit.bound.fulls:
                    t.hook_incoming(full, "unsharded_grads")

        for unit in self.unit_list:
            tracker.keep_handle(unit.module.register_forward_pre_hook(lambda _m, _a, unit=unit: after_gather(unit)))

    def comm_counters(self) -> list[C.CommCounter]:
        return [self.counter]
