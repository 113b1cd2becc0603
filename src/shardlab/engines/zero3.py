"""`zero3`: ZeRO stage 3 from scratch. Every parameter tensor lives, whole, on exactly one rank
(its owner); the others hold a meta-device placeholder in its place, so `module.parameters()`
yields what this rank owns and any `torch.optim` optimizer keeps state for exactly that.

engines/zero3_layout.py decides who owns what and cuts the model into units (the repeated
blocks, and the root for the rest), each owner's tensors of a unit travelling in one flat
buffer. This file is the schedule, in the order a step meets it:

    pre-forward      each owner broadcasts its tensors of the unit into fresh buffers (a
                     `Gather`), and the unit's modules see the full tensors
    post-forward     free the buffers (reshard_after_forward) and hook the outputs' gradients
    pre-backward     the buffers get their storage back and are broadcast again
    each gradient    copied into its owner's flat gradient buffer; a complete buffer is
                     reduced (averaged) onto the owner, who adds it into `p.grad`
    gradients in     free the gather (with frozen parameters: `_hooks.FrozenRelease` says when)
    end of backward  reduce what is incomplete, wait for every reduce, free what is left

Who holds what when, memory and traffic per step, and the limits: docs/engines.md.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from shardlab.engines import _hooks
from shardlab.engines import collectives as C
from shardlab.engines.api import CPUOffload, Engine, MixedPrecision, ShardPiece, accumulation_mode, is_meta
from shardlab.engines.measuring import Measurable, MemoryTracking
from shardlab.engines.planning import Collective, LocalTensor, ModelTraffic, Plannable, gathered_unit_traffic
from shardlab.engines.zero3_layout import (
    Slot,
    SlotGroup,
    SlotUnit,
    assign_owners,
    check_ownership,
    keep_owned_only,
    make_slots,
    make_units,
    materialize_owned,
    offload_owned,
)
from shardlab.models.init import canonical_names


class GatherState(enum.Enum):
    """The life of one gather (one forward run of a unit)."""

    FORWARD = "forward"        # gathered for its forward
    RESHARDED = "resharded"    # forward done, storage freed; its backward will re-gather
    BACKWARD = "backward"      # re-gathered: its backward is running
    RECOMPUTE = "recompute"    # gathered by an unforeseen forward inside backward: freed at its end
    RELEASED = "released"      # done: storage freed, modules unbound


@dataclass(eq=False)
class Gather:
    """One forward run of a unit: its full parameters and what is left of its backward."""

    unit: SlotUnit
    buffers: list[torch.Tensor]                 # per group, flat
    fulls: list[torch.Tensor]                   # per slot, views into buffers (autograd leaves)
    release: _hooks.FrozenRelease               # when it may be freed, holding frozen parameters
    state: GatherState = GatherState.FORWARD
    grad_buffers: dict[int, torch.Tensor] = field(default_factory=dict)   # group index -> flat grads
    arrived: set[int] = field(default_factory=set)      # slot positions whose gradient is in
    reduced: set[int] = field(default_factory=set)      # group indices already reduced


class Zero3Engine(Engine, Plannable, Measurable):
    """reshard_after_forward: free each unit's full parameters after its forward (False: keep
    them until its backward, one broadcast less for the whole model's parameters in memory).
    mixed_precision: gather and compute in `param_dtype`, reduce gradients in `reduce_dtype`;
    owned parameters, their gradients and the optimizer state stay in the parameters' own dtype,
    and the floating-point inputs of each unit are cast to `param_dtype` ([Note: which parameters
    mixed precision casts]).
    offload: CPUOffload keeps the owned parameters, their gradients and so the optimizer state in
    host memory (pinned where CUDA exists): the owner copies them to the device when it
    broadcasts, and a reduced gradient goes back to the host (`_hooks.ReducedGrads`).
    accumulate: "sharded" reduces every micro batch to the owners ([Note: sharded accumulation]
    in engines/api.py); "local" keeps the whole local sum until the last."""

    grads_sharded = True
    options = ("reshard_after_forward", "mixed_precision", "offload", "accumulate")
    # whole tensors go to owners by size over the whole model (zero3_layout.assign_owners): a cut
    # model's owners, and so its reduce buffers in flight at the peak, are not the real model's
    probe_whole_depth = True

    def __init__(self, module: nn.Module, *, reshard_after_forward: bool = True, mixed_precision: Any = None,
                 offload: Any = None, accumulate: str = "local", **kw: Any):
        super().__init__(module, **kw)
        self.accumulate = accumulation_mode(accumulate)
        self.offload = CPUOffload.parse(offload)
        self._grads = _hooks.ReducedGrads(self.offload, self.device)
        self.counter = C.CommCounter()
        self.reshard_after_forward = bool(reshard_after_forward)
        mp = MixedPrecision.parse(mixed_precision) or MixedPrecision()
        self.param_dtype = mp.param_dtype
        self.reduce_dtype = mp.reduce_dtype or mp.param_dtype
        self.sync_grads = True
        self._backward_end = _hooks.BackwardEnd(self._finish_backward)
        self._live: list[Gather] = []              # gathers that may hold storage, oldest first
        self._in_backward_of: dict[int, Gather] = {}   # id(unit) -> gather whose backward runs
        self._inflight: list[tuple[Any, SlotUnit, SlotGroup, torch.Tensor]] = []   # async reduces, oldest first
        self._inflight_bytes = 0
        self._memory_trackers: weakref.WeakSet = weakref.WeakSet()   # hook_memory_tracker's, once each

        meta = is_meta(module)
        if not meta:
            module.to(self.device)
            _hooks.broadcast_from_rank0([*module.parameters(), *module.buffers()], self.group, self.counter)
        params = list({id(p): p for p in module.parameters()}.values())
        owners = assign_owners(params, self.world_size)
        check_ownership(params, owners, self.world_size)
        self.slots = make_slots(params, canonical_names(module), owners, self._gathered_dtype_rule(module))
        self.owned_bytes = [sum(s.nbytes for s in self.slots if s.owner == r) for r in range(self.world_size)]
        slot_of = {id(p): s for p, s in zip(params, self.slots)}
        self.state_keys = _hooks.StateDictMirror(module, lambda p: slot_of[id(p)])
        self.unit_list = make_units(module, [module, *self.units], slot_of)
        self.unit_param_bytes = [u.param_bytes for u in self.unit_list]
        # see [Note: how many reduces may be in flight]: counted as the buffers are, in the reduce dtype
        self.max_inflight_bytes = 2 * max(sum(g.grad_numel * (self.reduce_dtype or g.dtype).itemsize
                                              for g in u.groups) for u in self.unit_list)
        keep_owned_only(module, slot_of, self.rank, self.device, meta)
        if meta:
            materialize_owned(module, self.slots, self.device)
            _hooks.broadcast_from_rank0(module.buffers(), self.group, self.counter)
        if self.offload is not None:
            offload_owned(module, self.slots, self.offload)
        for unit in self.unit_list:
            unit.module.register_forward_pre_hook(partial(self._pre_forward, unit), with_kwargs=True)
            unit.module.register_forward_hook(partial(self._post_forward, unit))

    # -- setup ----------------------------------------------------------------------------------
    def _gathered_dtype_rule(self, root: nn.Module):
        """The dtype each parameter is gathered and computed in (mixed precision's param_dtype).

        [Note: which parameters mixed precision casts]
        A module holding floating-point buffers (BatchNorm's running statistics) computes in
        their precision, and kernels want its parameters in the same dtype: such modules'
        parameters are gathered in their own dtype. Decided from buffers, not layer classes."""
        keep = {id(p) for m in root.modules()
                if any(b is not None and b.is_floating_point() for b in m._buffers.values())
                for p in m._parameters.values() if p is not None}

        def compute_dtype(p: nn.Parameter) -> torch.dtype:
            cast = self.param_dtype is not None and p.is_floating_point() and id(p) not in keep
            return self.param_dtype if cast else p.dtype

        return compute_dtype

    # -- gathering ------------------------------------------------------------------------------
    def _gather(self, unit: SlotUnit) -> Gather:
        buffers = [torch.empty(g.numel, dtype=g.dtype, device=self.device) for g in unit.groups]
        fulls: list[torch.Tensor] = [None] * len(unit.slots)  # type: ignore[list-item]
        for group, buffer in zip(unit.groups, buffers):
            for pos, off in zip(group.positions, group.offsets):
                slot = unit.slots[pos]
                fulls[pos] = buffer[off:off + slot.numel].view(slot.shape)
        gather = Gather(unit, buffers, fulls, _hooks.FrozenRelease(unit.trainable < len(unit.slots)))
        self._fill(gather, everything=True)
        if torch.is_grad_enabled():
            for pos, (slot, full) in enumerate(zip(unit.slots, fulls)):
                if slot.requires_grad:
                    full.requires_grad_(True)
                    full.register_post_accumulate_grad_hook(_hooks.weak_hook(self._on_grad, gather, pos))
        self._live.append(gather)
        return gather

    @torch.no_grad()
    def _fill(self, gather: Gather, everything: bool = False) -> None:
        """Broadcast every owner's tensors into the gather's buffers: all of them for a new
        gather, else those whose storage was freed (they get it back first). Writes go through
        `.data` ([Note: freeing storage under autograd's feet] in engines/fsdp.py)."""
        handles = []
        for group, buffer in zip(gather.unit.groups, gather.buffers):
            storage = buffer.untyped_storage()
            if storage.size() == 0 and group.numel:
                storage.resize_(group.numel * buffer.element_size())
            elif not everything:
                continue  # still gathered (reshard_after_forward=False): the values are current
            if group.owner == self.rank:
                for pos, off in zip(group.positions, group.offsets):
                    slot = gather.unit.slots[pos]
                    # offloaded: a host-to-device copy, asynchronous from pinned memory
                    buffer.data[off:off + slot.numel].copy_(slot.param.reshape(-1), non_blocking=slot.param.is_pinned())
            handles.append(C.broadcast(buffer.data, group.owner, self.group, async_op=True, counter=self.counter))
        for h in handles:
            if h is not None:
                h.wait()

    @staticmethod
    def _free(gather: Gather) -> None:
        for buffer in gather.buffers:
            buffer.untyped_storage().resize_(0)

    # [Note: how a unit's modules see the full tensors]
    # Writing the full tensor into the module's instance __dict__ shadows the registered
    # parameter: attribute lookup finds __dict__ before nn.Module.__getattr__ consults
    # _parameters. So forward code (`self.weight`) sees the full tensor while
    # `parameters()`, `state_dict()` and the optimizer keep seeing the owned Parameter.
    # Unbinding deletes the shadow (owners) or puts the meta placeholder back (others).

    def _bind(self, gather: Gather) -> None:
        for m, attr, pos in gather.unit.bindings:
            m.__dict__[attr] = gather.fulls[pos]
        gather.unit.bound = gather

    def _unbind(self, gather: Gather) -> None:
        unit = gather.unit
        if unit.bound is not gather:
            return
        for m, attr, pos in unit.bindings:
            if unit.slots[pos].param is not None:
                m.__dict__.pop(attr, None)
            else:
                m.__dict__[attr] = unit.slots[pos].placeholder
        unit.bound = None

    def _release(self, gather: Gather) -> None:
        self._free(gather)
        self._unbind(gather)
        gather.state = GatherState.RELEASED
        gather.grad_buffers.clear()
        if gather in self._live:
            self._live.remove(gather)
        if self._in_backward_of.get(id(gather.unit)) is gather:
            del self._in_backward_of[id(gather.unit)]

    # -- forward --------------------------------------------------------------------------------
    # A unit's forward hooks may fire again inside backward ([Note: forward hooks inside backward]
    # in engines/_hooks.py): the recompute then reads the gather whose backward runs, which
    # `_pre_backward` re-gathered and bound (bound again here: a unit run twice has two gathers,
    # and the other may be bound by now); a forward inside backward with no backward of its unit
    # running gathers for itself, and that gather is freed at the end of backward.

    def _pre_forward(self, unit: SlotUnit, module: nn.Module, args: tuple, kwargs: dict):
        args, kwargs = self._cast_inputs(args), self._cast_inputs(kwargs)
        if not unit.slots:
            return args, kwargs
        in_backward = _hooks.in_backward()
        recomputing = self._in_backward_of.get(id(unit)) if in_backward else None
        if recomputing is not None:
            self._bind(recomputing)
        else:
            if unit is self.unit_list[0] and not in_backward:
                self._drop_stale_gathers()
            gather = self._gather(unit)
            if in_backward:
                gather.state = GatherState.RECOMPUTE
            self._bind(gather)
            if not in_backward and torch.is_grad_enabled():
                # frozen parameters: see [Note: when a unit with frozen parameters may be freed] in engines/_hooks.py
                gather.release.arm(args, kwargs, partial(self._on_inputs_grad, gather))
        return args, kwargs

    def _post_forward(self, unit: SlotUnit, module: nn.Module, args: tuple, output: Any) -> None:
        if _hooks.in_backward():
            return  # activation-checkpoint recompute: see the comment above _pre_forward
        gather = unit.bound
        if gather is None:
            return
        # Even with every parameter of the unit frozen, backward through it needs the
        # parameters (for the gradient of its input): it re-gathers them all the same.
        if not _hooks.hook_output_grads(output, partial(self._pre_backward, gather)):
            self._release(gather)  # no backward will come for this forward (eval, no_grad)
            return
        self._unbind(gather)
        if self.reshard_after_forward:
            self._free(gather)
            gather.state = GatherState.RESHARDED

    def _drop_stale_gathers(self) -> None:
        """A new forward begins: gathers still holding storage belong to forwards whose
        backward has not run (reshard_after_forward=False, or a forward never
        backpropagated). Free them; should their backward come, it re-gathers."""
        for gather in list(self._live):
            if gather.state in (GatherState.FORWARD, GatherState.RESHARDED):
                self._free(gather)
                gather.state = GatherState.RESHARDED
                self._live.remove(gather)

    def _cast_inputs(self, value: Any) -> Any:
        return _hooks.cast_floating(value, self.param_dtype)

    # -- backward -------------------------------------------------------------------------------
    # [Note: one gradient per gathered tensor]
    # The output-gradient hook re-gathers ([Note: when the hooks fire], engines/_hooks.py).
    # Each full tensor is its own autograd leaf, so its post-accumulate-grad hook fires once
    # per gather with the whole gradient: both uses of GPT's tied embedding/head weight arrive together. A
    # unit that runs twice gathers twice, into two sets of leaves; each set's gradient is
    # reduced to the owner, who adds them up, as autograd would have. A parameter shared by
    # two units likewise arrives once per unit. Once every leaf of a gather has its gradient, no
    # backward node reads the gathered values any more, unless frozen parameters are among them
    # ([Note: when a unit with frozen parameters may be freed] in engines/_hooks.py): they are freed.

    def _pre_backward(self, gather: Gather, grad: torch.Tensor) -> None:
        if gather.state is GatherState.BACKWARD:
            return  # another output of the same forward got here first
        # "released" too: a second backward through a graph kept with retain_graph=True
        gather.arrived.clear()
        gather.reduced.clear()
        gather.release.restart()
        self._backward_end.arm()
        self._fill(gather)
        gather.state = GatherState.BACKWARD
        if gather not in self._live:
            self._live.append(gather)
        self._in_backward_of[id(gather.unit)] = gather
        self._bind(gather)  # for an activation-checkpoint recompute

    @torch.no_grad()
    def _on_grad(self, gather: Gather, pos: int, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        slot = gather.unit.slots[pos]
        if not self.sync_grads:
            slot.unsynced.keep(grad, slot.dtype, copy=True)
        else:
            grad = slot.unsynced.take(grad)
            gi, off = gather.unit.place[pos]
            buffer = gather.grad_buffers.get(gi)
            if buffer is None:
                buffer = gather.grad_buffers[gi] = torch.zeros(
                    gather.unit.groups[gi].grad_numel, dtype=self.reduce_dtype or grad.dtype, device=self.device)
            buffer[off:off + slot.numel].copy_(grad.reshape(-1))
        gather.arrived.add(pos)
        if self.sync_grads:
            self._reduce_complete_groups(gather)
        if self._backward_done(gather):
            self._release(gather)

    @staticmethod
    def _backward_done(gather: Gather) -> bool:
        return gather.release.may_free(len(gather.arrived) >= gather.unit.trainable)

    def _on_inputs_grad(self, gather: Gather, _grads: Any) -> None:
        if gather.state is not GatherState.BACKWARD:
            return
        gather.release.fired()
        if self._backward_done(gather):
            self._release(gather)

    # [Note: how many reduces may be in flight]
    # A reduce is launched asynchronously as soon as an owner's gradient buffer of a unit is
    # complete, so it overlaps the backward of earlier units, and the buffer must stay alive
    # until it completes: bounding what is in flight bounds the backward peak. A unit leaves as up
    # to N reduces of very different sizes (a whole embedding owned by one rank, a bias by
    # another), launched at different moments and interleaved with the next unit's: no unit is
    # ever "in flight" as one thing, and counting reduces would let a bias-sized one stand for a
    # unit's worth of bytes. So zero3 counts bytes: once the buffers of the reduces in flight
    # exceed `max_inflight_bytes`, twice the largest unit's gradient buffers (its trainable
    # parameters in the reduce dtype, the bytes the buffers have: a cap in parameter bytes let a
    # bf16 reduce of fp32 parameters through at twice the units, and a LoRA unit's small gradients
    # at many times), the oldest reduce is waited for. fsdp counts units instead ([Note: how many
    # reduce-scatters may be in flight] in engines/fsdp.py), and its objection applies here: with
    # a large root unit (a GPT's embedding) the cap admits several blocks' gradients at once. It
    # is kept as measured (docs/memory.md's zero3 peaks are with it); a cap in bytes per block,
    # not per largest unit, is the tighter bound it leaves open. The broadcasts that re-gather a
    # unit, by contrast, are waited for at once: backward needs the values. At the end of backward
    # ([Note: why we wait where we wait] in engines/_hooks.py) the gradient buffers left
    # incomplete because some parameter got no gradient this time are reduced (in the same order
    # on every rank, so the reduces pair up), every reduce is waited for, and whatever is still
    # gathered is freed.

    def _reduce_complete_groups(self, gather: Gather, flush: bool = False) -> None:
        """Reduce each owner's gradient buffer once all its gradients are in (or, at the end
        of backward, whatever arrived: parameters unused in this backward count as zero)."""
        for gi, group in enumerate(gather.unit.groups):
            buffer = gather.grad_buffers.get(gi)
            if gi in gather.reduced or not group.grad_positions:
                continue  # already reduced, or frozen
            if not flush and not all(p in gather.arrived for p in group.grad_positions):
                continue
            if buffer is None:
                buffer = torch.zeros(group.grad_numel, dtype=self.reduce_dtype or group.dtype, device=self.device)
            # averaged, never summed: [Note: why average] (engines/api.py)
            handle = C.reduce(buffer, group.owner, self.group, average=True, async_op=True, counter=self.counter)
            gather.reduced.add(gi)
            gather.grad_buffers.pop(gi, None)
            self._inflight.append((handle, gather.unit, group, buffer))
            self._inflight_bytes += buffer.numel() * buffer.element_size()
            while self._inflight_bytes > self.max_inflight_bytes:
                self._complete_oldest_reduce()

    def _complete_oldest_reduce(self) -> None:
        """Wait for the oldest reduce in flight; the owner adds the average to `p.grad`."""
        handle, unit, group, buffer = self._inflight.pop(0)
        self._inflight_bytes -= buffer.numel() * buffer.element_size()
        if handle is not None:
            handle.wait()
        if group.owner != self.rank:
            return
        for pos, off in zip(group.grad_positions, group.grad_offsets):
            slot = unit.slots[pos]
            self._grads.add(slot.param, buffer[off:off + slot.numel].view(slot.shape))

    def _finish_backward(self) -> None:
        for gather in list(self._live):
            if gather.state is GatherState.BACKWARD and self.sync_grads:
                self._reduce_complete_groups(gather, flush=True)
            if gather.state in (GatherState.BACKWARD, GatherState.RECOMPUTE):
                self._release(gather)
        while self._inflight:
            self._complete_oldest_reduce()
        self._in_backward_of.clear()
        self._grads.flush()

    # -- the training contract (engines/api.py) ----------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        full: dict[Slot, torch.Tensor] = {}
        for slot in self.slots:
            t = slot.param.detach().to(self.device, copy=True) if slot.param is not None else torch.empty(
                slot.shape, dtype=slot.dtype, device=self.device)
            C.broadcast(t, slot.owner, self.group, counter=self.counter)
            full[slot] = t.to("cpu")
        return self.state_keys.full(full)

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        missing = self.state_keys.missing(state)
        if missing:
            raise KeyError(f"zero3: state dict lacks {missing}")
        for k in self.state_keys.keys:
            if k.param is not None and k.param.param is not None:
                k.param.param.copy_(state[k.key])
        self.state_keys.load_buffers(state)

    def shard_layout(self) -> list[tuple[nn.Parameter, list[ShardPiece]]]:
        """Every owned Parameter is one whole original parameter."""
        return [(s.param, [ShardPiece(s.name, s.shape, 0, 0, s.numel)]) for s in self.slots if s.param is not None]

    # -- Plannable (engines/planning.py) -----------------------------------------------------------
    @classmethod
    def planned_state(cls, params: list[nn.Parameter], world: int, options: Mapping[str, Any]
                      ) -> list[list[LocalTensor]] | None:
        """One rank owns everything whole; over several, ownership is the engine's own choice
        (engines/zero3_layout.py): built, not re-derived."""
        return super().planned_state(params, world, options) if world == 1 else None

    def rank_states(self) -> list[list[LocalTensor]]:
        """Every rank's owned tensors: ownership is known on every rank."""
        states: list[list[LocalTensor]] = [[] for _ in range(self.world_size)]
        for s in self.slots:
            states[s.owner].append(LocalTensor(s.numel, s.placeholder.element_size(), s.requires_grad))
        return states

    @classmethod
    def step_traffic(cls, model: ModelTraffic, options: Mapping[str, Any]) -> list[Collective]:
        """Every unit broadcast in forward and again in backward (the root too), gradients reduced
        to their owners once per step (sharded accumulation: per micro batch), over all ranks."""
        return gathered_unit_traffic(model, "broadcast", "reduce", model.world, root_kept=False,
                                     accumulate=options.get("accumulate", "local"))

    # -- Measurable (engines/measuring.py) ---------------------------------------------------------
    def comm_counters(self) -> list[C.CommCounter]:
        return [self.counter]

    def memory_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for gather in self._live:
            for b in gather.buffers:
                yield "gathered_params", b
            for b in gather.grad_buffers.values():
                yield "unsharded_grads", b             # a unit's gradients per owner, before the reduce
        for _handle, _unit, _group, buffer in self._inflight:
            yield "unsharded_grads", buffer            # being reduced (the owner's `.grad` views claim it later)
        for slot in self.slots:
            if slot.unsynced.kept is not None:
                yield "unsharded_grads", slot.unsynced.kept

    def hook_memory_tracker(self, tracker: MemoryTracking) -> None:
        """New leaves are made at every gather: a forward pre-hook on each unit, after the
        engine's (which gathered), hooks the gathered tensors of this forward. Once per tracker."""
        if tracker in self._memory_trackers:
            return
        self._memory_trackers.add(tracker)
        tracker_ref = weakref.ref(tracker)

        def after_gather(unit: SlotUnit) -> None:
            t = tracker_ref()
            if t is not None and t.tracking and unit.bound is not None:
                for full in unit.bound.fulls:
                    t.hook_incoming(full, "unsharded_grads")

        for unit in self.unit_list:
            tracker.keep_handle(unit.module.register_forward_pre_hook(
                lambda _m, *a, unit=unit: after_gather(unit), with_kwargs=True))

