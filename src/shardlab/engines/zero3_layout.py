"""How `zero3` lays a model out: who owns each parameter tensor, the units, and what each rank
keeps.

Ownership. Each parameter tensor (tied names share one) is owned whole by one rank. The
trainable tensors are placed first, largest first, each onto the rank owning the fewest
trainable bytes so far (ties: lowest rank); then the frozen ones, largest first, onto the rank
owning the fewest bytes in all. Trainable bytes (parameter, gradient and optimizer state) are
balanced to within one tensor, all bytes nearly so, and with at least as many non-empty
trainable tensors as ranks every rank owns one: its first N placements go to N distinct ranks.
With fewer, some ranks hold only frozen weights (they train nothing; the loss scaler and the
gradient norm still count them in), or nothing at all (fewer tensors than ranks: such a rank
can build no optimizer, and `shardlab train` refuses the run); the engine says which and why
when it is built.

Units. The model is cut into units (its repeated blocks by default) plus the root, which
holds everything outside them (embeddings, the tied head, the final norm). A unit's
parameters are those registered in its modules that are not inside a nested unit; within a
unit, each owner's tensors (per compute dtype) travel in one flat buffer (`SlotGroup`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardlab.engines._hooks import NoSyncGrad
from shardlab.engines.api import CPUOffload
from shardlab.models.init import init_parameters_


@dataclass(eq=False)
class Slot:
    """One original parameter (tied names share a slot)."""

    name: str                                   # canonical name (first in named_parameters)
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    owner: int
    compute_dtype: torch.dtype                  # dtype of the gathered copy
    placeholder: torch.Tensor                   # meta tensor standing in on non-owners
    param: nn.Parameter | None = None           # the owner's tensor (its own dtype); None elsewhere
    unsynced: NoSyncGrad = field(default_factory=NoSyncGrad)  # local gradient accumulated under no_sync

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.numel * self.placeholder.element_size()


@dataclass(eq=False)
class SlotGroup:
    """The slots of one unit owned by one rank: they travel in one flat buffer. Their gradients
    travel in another, which holds the trainable slots only: frozen slots are never reduced."""

    owner: int
    dtype: torch.dtype                          # compute dtype of the gathered buffer
    positions: list[int]                        # indices into unit.slots
    offsets: list[int]
    numel: int
    grad_positions: list[int] = field(default_factory=list)  # the trainable ones among positions
    grad_offsets: list[int] = field(default_factory=list)    # their offsets in the gradient buffer
    grad_numel: int = 0


@dataclass(eq=False)
class SlotUnit:
    module: nn.Module
    slots: list[Slot]
    bindings: list[tuple[nn.Module, str, int]]  # (module, attribute, index into slots)
    groups: list[SlotGroup]
    place: list[tuple[int, int]]                # per trainable slot: (index into groups, offset in its gradient buffer)
    trainable: int                              # how many slots require grad
    bound: Any = None                           # the gather (zero3.Gather) whose tensors the modules see now

    @property
    def param_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


def assign_owners(params: list[nn.Parameter], world: int) -> list[int]:
    """Each parameter's owner, as the module docstring says: trainable tensors first, then frozen."""
    size = [p.numel() * p.element_size() for p in params]
    owned, trainable_owned = [0] * world, [0] * world
    owners = [0] * len(params)
    for trainable in (True, False):
        load = trainable_owned if trainable else owned
        for i in sorted((i for i, p in enumerate(params) if p.requires_grad == trainable), key=lambda i: -size[i]):
            rank = min(range(world), key=lambda r: load[r])
            owners[i] = rank
            owned[rank] += size[i]
            if trainable:
                trainable_owned[rank] += size[i]
    return owners


def check_ownership(params: list[nn.Parameter], owners: list[int], world: int) -> None:
    """Say, before training, which ranks own nothing or no trainable tensor, and why. Every rank
    computes the same owners, so every rank says the same. A rank owning nothing still takes
    part in every collective; it just has nothing to optimize (torch.optim refuses an empty
    parameter list, and `shardlab train` refuses such a run)."""
    holding = [[i for i, o in enumerate(owners) if o == r] for r in range(world)]
    empty = [r for r, mine in enumerate(holding) if not mine]
    if empty:
        warnings.warn(f"zero3 at world size {world}: rank(s) {empty} own no parameter: the model has "
                      f"{len(params)} parameter tensors for {world} ranks, and zero3 gives each tensor whole to one "
                      f"rank. Use at most {len(params)} workers, or an engine that slices every tensor (fsdp, "
                      "torch-fsdp).", stacklevel=3)
        return
    idle = [r for r, mine in enumerate(holding) if not any(params[i].requires_grad for i in mine)]
    if idle and any(p.requires_grad for p in params):
        trainable = sum(p.requires_grad for p in params)
        warnings.warn(f"zero3 at world size {world}: rank(s) {idle} own only frozen parameters (the model has "
                      f"{trainable} trainable tensor(s) for {world} ranks): they hold their share of the frozen "
                      "weights and update nothing.", stacklevel=3)


def make_slots(params: list[nn.Parameter], names: dict[int, str], owners: list[int],
               compute_dtype: Callable[[nn.Parameter], torch.dtype]) -> list[Slot]:
    return [Slot(names[id(p)], p.shape, p.dtype, p.requires_grad, owners[i], compute_dtype(p),
                 torch.empty(p.shape, dtype=p.dtype, device="meta"))
            for i, p in enumerate(params)]


def make_units(root: nn.Module, unit_modules: list[nn.Module], slot_of: dict[int, Slot]) -> list[SlotUnit]:
    """Assign every module to its nearest enclosing unit (the root for the rest), and lay out
    each unit's parameters in one flat buffer per (owner, dtype)."""
    is_unit = {id(m): i for i, m in enumerate(unit_modules)}
    regions: list[list[nn.Module]] = [[] for _ in unit_modules]
    seen: set[int] = set()

    def walk(m: nn.Module, current: int) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        current = is_unit.get(id(m), current)
        regions[current].append(m)
        for child in m.children():
            walk(child, current)

    walk(root, 0)
    return [_make_unit(m, region, slot_of) for m, region in zip(unit_modules, regions)]


def _make_unit(module: nn.Module, region: list[nn.Module], slot_of: dict[int, Slot]) -> SlotUnit:
    slots: list[Slot] = []
    bindings = []
    for sub in region:
        for attr, p in sub._parameters.items():
            if p is None:
                continue
            slot = slot_of[id(p)]
            if slot not in slots:
                slots.append(slot)
            bindings.append((sub, attr, slots.index(slot)))
    by_key: dict[tuple[int, torch.dtype], SlotGroup] = {}
    for pos, slot in enumerate(slots):
        key = (slot.owner, slot.compute_dtype)
        group = by_key.setdefault(key, SlotGroup(slot.owner, slot.compute_dtype, [], [], 0))
        group.positions.append(pos)
        group.offsets.append(group.numel)
        group.numel += slot.numel
        if slot.requires_grad:
            group.grad_positions.append(pos)
            group.grad_offsets.append(group.grad_numel)
            group.grad_numel += slot.numel
    groups = sorted(by_key.values(), key=lambda g: (g.owner, str(g.dtype)))
    place = [(0, 0)] * len(slots)
    for gi, group in enumerate(groups):
        for pos, off in zip(group.grad_positions, group.grad_offsets):
            place[pos] = (gi, off)
    return SlotUnit(module, slots, bindings, groups, place, sum(s.requires_grad for s in slots))


def keep_owned_only(root: nn.Module, slot_of: dict[int, Slot], rank: int, device: torch.device, meta: bool) -> None:
    """Owners keep (or, from meta, create) the parameter; everyone else drops it."""
    for m in list({id(m): m for m in root.modules()}.values()):
        for attr, p in list(m._parameters.items()):
            if p is None:
                continue
            slot = slot_of[id(p)]
            if slot.owner != rank:
                del m._parameters[attr]
                m.__dict__[attr] = slot.placeholder
                continue
            if slot.param is None:
                slot.param = (nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                           requires_grad=p.requires_grad) if meta else p)
            m._parameters[attr] = slot.param


@torch.no_grad()
def materialize_owned(root: nn.Module, slots: list[Slot], device: torch.device) -> None:
    """Initialize what this rank owns exactly as a whole build would (name-keyed seeds), and give
    buffers storage (the engine then makes them equal to rank 0's)."""
    for m in root.modules():
        for attr, b in m._buffers.items():
            if b is not None and b.device.type == "meta":
                m._buffers[attr] = torch.empty_like(b, device=device)
    owned = {id(s.param): s.name for s in slots if s.param is not None}
    init_parameters_(root, getattr(root, "init_seed", 0), names=owned)


@torch.no_grad()
def offload_owned(root: nn.Module, slots: list[Slot], offload: CPUOffload) -> None:
    """Move every owned Parameter to host memory (pinned per the policy); buffers stay on the device."""
    for slot in slots:
        if slot.param is None:
            continue
        host = offload.host_tensor(slot.param)
        host.copy_(slot.param)
        new = nn.Parameter(host, requires_grad=slot.param.requires_grad)
        for m in root.modules():
            for attr, p in m._parameters.items():
                if p is slot.param:
                    m._parameters[attr] = new
        slot.param = new
