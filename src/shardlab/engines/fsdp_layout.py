"""How `fsdp` lays a model out: units, their flat groups, and this rank's shard of each.

The model is cut into units: the root (for the parameters outside every wrap unit) and the
wrap units; each module belongs to the innermost unit that contains it. A unit's parameters
form one flat group per (requires_grad, dtype), laid end to end and padded to a multiple of the
shard group's size S; this rank keeps its 1/S slice as an `nn.Parameter`, the shard, and the
original names become shape-only placeholders. From the meta device one unit is materialized
at a time (its parameters initialized by name, as a whole build would: models/init.py), so the
whole model never exists on any rank. `build_flat_units` does it in named steps; the engine
(engines/fsdp.py) then schedules gathers and reductions over what it returns, and each unit's
`UnitState` decides when the unit is freed in backward.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardlab.engines._hooks import FrozenRelease, NoSyncGrad
from shardlab.engines.api import CPUOffload, ShardPiece
from shardlab.models.init import RANGE_READERS_ATTR, init_parameters_


class Storage(enum.Enum):
    """Where a unit's full buffers are: freed, being all-gathered (async), or usable."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


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
    unsynced: NoSyncGrad = field(default_factory=NoSyncGrad)  # no_sync accumulation (full size, the shard's dtype)

    @property
    def trainable(self) -> bool:
        return self.shard.requires_grad


class UnitState:
    """Where one unit is in this step, and so when it is freed in backward: the one place that
    decides it. The engine's hooks report each transition; those returning a bool answer "free
    the unit now". A unit without frozen groups is freed as soon as every trainable group's
    parameters have their gradients, before the flat gradients are made ([Note: freeing a unit
    before its flat gradient exists] in engines/fsdp.py); one with frozen groups once the flat
    gradients are in and its inputs' gradients too (`FrozenRelease`); any unit still held, at the
    end of backward."""

    def __init__(self, trainable: int = 0, frozen: bool = False):
        self.trainable = trainable          # trainable groups: the gradients a backward brings
        self.release = FrozenRelease(frozen)
        self.backward_due = False           # ran forward with grad: its backward will come
        self.views_tracked = False          # autograd-connected views installed for this step
        self.grads_due = 0                  # trainable groups whose flat gradient has not arrived
        self.computed: set[int] = set()     # trainable groups (ids) whose parameters' gradients are all in

    @property
    def idle(self) -> bool:
        """Nothing of a backward is due: the state between steps."""
        return not (self.backward_due or self.views_tracked)

    def ran_forward(self) -> None:
        """A forward with grad enabled used the unit: its backward will come."""
        self.backward_due = True

    def connected_views(self) -> None:
        """Autograd-connected views were installed: each trainable group's gradient is now due."""
        self.views_tracked = True
        self.grads_due = self.trainable

    def grads_computed(self, group: int) -> bool:
        """A trainable group's parameters all have their gradients (its SplitBackward runs next).
        True: it was the unit's last, and no frozen group holds the unit longer."""
        if not self.views_tracked or group in self.computed:
            return False
        self.computed.add(group)
        return len(self.computed) == self.trainable and not self.release.frozen

    def grad_arrived(self) -> bool:
        """A trainable group's flat gradient reached its leaf. True: the unit is done."""
        self.grads_due = max(0, self.grads_due - 1)
        return self.release.may_free(self.grads_due == 0)

    def inputs_arrived(self) -> bool:
        """The gradients of one forward call's inputs are complete. True: the unit is done."""
        self.release.fired()
        return self.backward_due and self.release.may_free(self.grads_due == 0)

    def finished(self) -> None:
        """Done for this step (freed by the engine): back to idle."""
        self.backward_due = self.views_tracked = False
        self.grads_due = 0
        self.computed.clear()
        self.release.reset()


@dataclass(eq=False)
class FlatUnit:
    """A wrap unit (or the root's remaining parameters): its groups are gathered, used and freed
    together. One group per (requires_grad, dtype) found in it, trainable groups first."""

    module: nn.Module
    is_root: bool
    groups: list[FlatGroup] = field(default_factory=list)
    storage: Storage = Storage.SHARDED
    state: UnitState = field(default_factory=UnitState)   # set once the groups are made


@dataclass(frozen=True)
class ShardSpec:
    """Where and how this rank keeps its shards."""

    device: torch.device
    shard_size: int                        # S: ranks a flat buffer is sliced over
    shard_rank: int                        # which slice is this rank's
    offload: CPUOffload | None             # shards in host memory
    param_dtype: torch.dtype | None        # the gathered buffers' dtype (None: the parameters' own)


@dataclass
class _Tree:
    """Which unit each module belongs to, and the parameters with every place they are bound."""

    owners: list[nn.Module]                # the root, then the wrap units
    unit_of_module: dict[int, int]         # id(module) -> index into owners (the innermost unit)
    parent: dict[int, int | None]          # unit index -> the unit it is nested in
    bindings: dict[int, list[tuple[nn.Module, str]]] = field(default_factory=dict)  # id(param) -> places
    tensors: dict[int, nn.Parameter] = field(default_factory=dict)                 # id(param) -> param


def build_flat_units(root: nn.Module, units: list[nn.Module], names: dict[int, str], spec: ShardSpec, *,
                     meta: bool) -> list[FlatUnit]:
    """The root's and every wrap unit's flat groups (units without parameters left out), root
    first. meta: the model is on the meta device (each unit is materialized in turn)."""
    tree = _unit_tree(root, units)
    members = _members(tree, names)
    range_readers = getattr(root, RANGE_READERS_ATTR, None) if meta else None
    materialized: dict[int, str] = dict(names)
    flat_units = []
    for ui, owner in enumerate(tree.owners):
        pids = members[ui]
        region = [m for m in owner.modules() if tree.unit_of_module.get(id(m)) == ui]
        readers: dict[int, Any] = {}  # pid -> read(start, end): left on meta, only our range is read
        if meta:
            if range_readers is not None:
                readers = range_readers([tree.tensors[pid] for pid in pids], names)
            _materialize_unit(root, tree, pids, region, readers, names, materialized, spec.device)
        else:
            for m in region:
                for bname, b in m._buffers.items():
                    if b is not None:
                        m._buffers[bname] = b.to(spec.device)
        if pids:
            flat_units.append(_flatten_unit(owner, ui == 0, tree, pids, names, readers, spec))
    return flat_units


def _unit_tree(root: nn.Module, units: list[nn.Module]) -> _Tree:
    """Each module's innermost unit, and how units nest."""
    owners = [root, *units]
    unit_ids = {id(u) for u in units}
    unit_of_module: dict[int, int] = {}
    parent: dict[int, int | None] = {0: None}
    for ui, owner in enumerate(owners):
        stack, seen = [owner], set()
        while stack:
            m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            if m is not owner and id(m) in unit_ids:
                parent[owners.index(m)] = ui
                continue
            unit_of_module[id(m)] = ui
            stack.extend(m.children())
    tree = _Tree(owners, unit_of_module, parent)
    for m in root.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                tree.bindings.setdefault(id(p), []).append((m, attr))
                tree.tensors[id(p)] = p
    return tree


def _members(tree: _Tree, names: dict[int, str]) -> list[list[int]]:
    """The parameters of each unit: a tied parameter goes to the innermost unit that contains all
    of its bindings (so that unit is gathered at every use)."""
    def ancestry(ui: int) -> list[int]:
        path = [ui]
        while tree.parent.get(path[-1]) is not None:
            path.append(tree.parent[path[-1]])
        return path[::-1]

    members: list[list[int]] = [[] for _ in tree.owners]
    order = {pid: i for i, pid in enumerate(names)}
    for pid in sorted(tree.bindings, key=order.__getitem__):
        paths = [ancestry(tree.unit_of_module[id(m)]) for m, _ in tree.bindings[pid]]
        common = 0
        for level in zip(*paths):
            if len(set(level)) > 1:
                break
            common = level[0]
        members[common].append(pid)
    return members


def _materialize_unit(root: nn.Module, tree: _Tree, pids: list[int], region: list[nn.Module],
                      readers: dict[int, Any], names: dict[int, str], materialized: dict[int, str],
                      device: torch.device) -> None:
    """Give this unit only real storage: its parameters and its modules' buffers, initialized as a
    whole build would. Parameters the model reads by range (pretrained weights) stay meta: the
    group reads the range this rank keeps (see [Note: reading a flat range by rows] in models/hf_load.py)."""
    for pid in pids:
        if pid in readers:
            continue
        p = tree.tensors[pid]
        new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
        materialized[id(new)] = names[pid]
        for m, attr in tree.bindings[pid]:
            m._parameters[attr] = new
        tree.tensors[pid] = new
    for m in region:
        for bname, b in m._buffers.items():
            if b is not None and b.device.type == "meta":
                m._buffers[bname] = torch.empty_like(b, device=device)
    init_modules = region + [m for pid in pids for m, _ in tree.bindings[pid]]
    init_parameters_(root, getattr(root, "init_seed", 0), modules=init_modules, names=materialized)


def _flatten_unit(owner: nn.Module, is_root: bool, tree: _Tree, pids: list[int], names: dict[int, str],
                  readers: dict[int, Any], spec: ShardSpec) -> FlatUnit:
    """[Note: frozen and trainable parameters in one unit]
    One flat group per (requires_grad, dtype): a shard is one Parameter, so it is either trained
    or not, and holds one dtype. Frozen groups are gathered and freed with the unit's trainable
    ones, but their shard has requires_grad=False (torch optimizers and clip_grad_norm_ skip it:
    it never has a .grad), their full buffer is no autograd leaf, and nothing of theirs is
    reduce-scattered."""
    unit = FlatUnit(owner, is_root)
    keys: dict[tuple[bool, torch.dtype], list[int]] = {}
    for pid in pids:
        keys.setdefault((tree.tensors[pid].requires_grad, tree.tensors[pid].dtype), []).append(pid)
    first_dtype = tree.tensors[pids[0]].dtype
    for (trainable, dtype), group_pids in sorted(keys.items(), key=lambda kv: not kv[0][0]):
        name = "flat_shard" + ("" if trainable else "_frozen")
        name += "" if dtype == first_dtype else "_" + str(dtype).removeprefix("torch.")
        params = [(names[pid], tree.tensors.pop(pid), tree.bindings[pid], readers.pop(pid, None))
                  for pid in group_pids]
        unit.groups.append(_make_group(unit, params, name, spec))
        del params  # the full tensors die here: one unit materialized at a time
    unit.state = UnitState(sum(g.trainable for g in unit.groups), any(not g.trainable for g in unit.groups))
    return unit


@torch.no_grad()
def _make_group(unit: FlatUnit, params: list, shard_name: str, spec: ShardSpec) -> FlatGroup:
    """Flatten `params` (name, full tensor, bindings, range reader or None), all of one
    requires_grad and dtype, keep this rank's slice, drop the rest. A parameter with a range
    reader is a meta tensor: only the elements of this rank's slice are read."""
    dtype, trainable = params[0][1].dtype, params[0][1].requires_grad
    entries, offset = [], 0
    for name, p, binds, _read in params:
        entries.append(FlatEntry(name, p.shape, offset, p.numel(), binds))
        offset += p.numel()
    # [Note: padding]
    # The flat buffer is padded to a multiple of S so that every rank's slice has the same size:
    # all-gather and reduce-scatter are then single calls, and a rank may hold no piece of some
    # parameters. The padded tail belongs to no parameter. SplitBackward fills its gradient with
    # zeros, so after averaging it is exactly zero, the optimizer (even with weight decay) keeps
    # it zero, and `clip_grad_norm_` is unaffected.
    padded = -(-offset // spec.shard_size) * spec.shard_size
    shard_numel = padded // spec.shard_size
    if spec.offload is not None:
        shard = spec.offload.host_tensor(params[0][1], shard_numel).zero_()
    else:
        shard = torch.zeros(shard_numel, dtype=dtype, device=spec.device)
    sources = {name: (p, read) for name, p, _binds, read in params}
    for piece in slice_pieces(entries, spec.shard_rank * shard_numel, shard_numel):
        p, read = sources[piece.name]
        start, end = piece.offset, piece.offset + piece.numel
        value = read(start, end) if read is not None else p.detach().reshape(-1)[start:end]
        shard[piece.local_start:piece.local_start + piece.numel].copy_(value)
    for e in entries:  # the full tensors are freed here: no attribute refers to them now
        for m, attr in e.bindings:
            del m._parameters[attr]
    shard_param = nn.Parameter(shard, requires_grad=trainable)
    unit.module.register_parameter(shard_name, shard_param)
    compute_dtype = spec.param_dtype if spec.param_dtype is not None and dtype.is_floating_point else dtype
    full = torch.empty(padded, dtype=compute_dtype, device=spec.device)
    full.requires_grad_(trainable)
    full.untyped_storage().resize_(0)
    group = FlatGroup(unit, entries, shard_param, full, full.data, [e.numel for e in entries] + [padded - offset])
    for e in entries:  # outside forward/backward the original names are shape-only placeholders
        for m, attr in e.bindings:
            setattr(m, attr, torch.empty(e.shape, dtype=compute_dtype, device="meta"))
    return group


def slice_pieces(entries: list[FlatEntry], start: int, numel: int) -> list[ShardPiece]:
    """The pieces of original parameters that elements [start, start + numel) of a flat buffer
    hold (a rank's slice): one per entry overlapping the slice, its offsets counted as ShardPiece
    counts them (in the flattened parameter, and in the slice). An entry outside the slice gives
    none: a rank may hold no piece of some parameters ([Note: padding])."""
    pieces = []
    for e in entries:
        lo, hi = max(start, e.offset), min(start + numel, e.offset + e.numel)
        if lo < hi:
            pieces.append(ShardPiece(e.name, e.shape, lo - e.offset, lo - start, hi - lo))
    return pieces
