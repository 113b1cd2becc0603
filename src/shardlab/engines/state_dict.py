"""`model.state_dict()` and `model.load_state_dict()` on the module `parallelize` returns: the
user's module's keys on every engine, so a state dict is written and read the same way whatever
the strategy, and `torch.distributed.checkpoint.state_dict` (get/set_state_dict) runs unchanged.

What each engine needs of it:
- the replicated engines (single, ddp, ddp-minimal, torch-ddp) return the user's module with its
  own parameters: its state_dict is already right (torch-ddp drives PyTorch's DDP from hooks on
  that module instead of handing out DDP's wrapper, whose keys carry `module.`: engines/native.py);
- torch-fsdp: FSDP2 keeps the names and gives DTensors; `ModuleDTensorState` adds the load of a
  plain (full) state dict, which FSDP2 refuses ("mixed torch.Tensor and DTensor");
- the from-scratch sharded engines (zero3, fsdp and their minimal twins) replace the module's
  parameters (owned whole tensors, flat slices), so its own state_dict names what they hold:
  `ShardedModuleState` puts the user's keys back, from the keys each engine records before it
  replaces anything (`StateDictMirror`, engines/state_keys.py).

[Note: what model.state_dict() holds]
FSDP2's `state_dict()` gives each parameter as a DTensor, Shard(0) over the ranks in torch.chunk
rows, whose `full_tensor()` gathers it; DCP saves DTensors sharded and reshards them at load, and
`get_model_state_dict(..., full_state_dict=True)` gathers them. That is the default here on every
sharded engine (`parallelize(..., state_dict="sharded")`), so an FSDP2 user's code runs as it is.
zero3's whole tensors on owners and fsdp's flat slices, which cut rows anywhere, are not layouts
a DTensor can describe, so a state dict is not a view of what the engine holds: state_dict()
gathers each parameter in turn (a sum over the ranks of the pieces each holds, `shard_layout`,
zeros elsewhere: exact, one parameter in memory at a time) and keeps this rank's torch.chunk rows,
copied. Two consequences: it is a collective, so every rank calls it (FSDP2's is local); and a
state dict is not the model, so `dcp.load` into it changes nothing until `load_state_dict` (which
DCP's own recipes and set_state_dict call). `state_dict="full"` gives full CPU tensors instead
(every rank calls it, rank 0 may then `torch.save` them and a plain module loads the file); the
default's DTensors fail in a plain module's `load_state_dict`, as FSDP2's do.

[Note: broadcast_from_rank0 on an engine that replaced the parameters]
DCP's `StateDictOptions(broadcast_from_rank0=True)` gives rank 0 the whole state dict and the other
ranks nothing; every rank receives every tensor, and each keeps those whose keys its module's
`named_parameters()` lists. FSDP2 and the replicated engines list the module's own keys; zero3 and
fsdp (and their minimal twins) list what they hold instead (owned whole tensors, flat slices), so the
other ranks keep none
of the module's keys and their load fails, naming the calls that work on every engine: the whole
state dict on every rank (`set_model_state_dict(..., full_state_dict=True)`, or
`shardlab.load_full_state_dict`), or DCP's sharded `dcp.load` of a saved checkpoint.

`load_state_dict` takes either: a plain tensor is the full value (each rank copies the pieces it
holds, no communication); a DTensor is gathered first (`full_tensor()`: a collective). Keys the
engine registers itself (fsdp's `flat_shard`, what DCP's full-state-dict load adds from
`named_parameters()`) load onto themselves when the dict lacks them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardlab.engines import collectives
from shardlab.engines._hooks import StateDictMirror, StateKey
from shardlab.engines.api import Engine, ShardPiece

STATE_DICT_VALUES = ("sharded", "full")


def install_state_dict(engine: Engine, values: str) -> None:
    """Make `engine.module`'s state_dict and load_state_dict use the user's keys ([Note: what
    model.state_dict() holds]); values: "sharded" (DTensors, the default) or "full"."""
    mirror = getattr(engine, "state_keys", None)
    if isinstance(mirror, StateDictMirror):
        ShardedModuleState(engine, mirror, values).install(engine.module)
        register_local_parameters(engine)
    elif any(_is_dtensor(p) for p in engine.local_parameters()):
        ModuleDTensorState(engine, values).install(engine.module)


def _is_dtensor(t: Any) -> bool:
    """Asked without importing torch.distributed.tensor (0.5 s), which only DTensor users need."""
    return isinstance(t, torch.Tensor) and hasattr(t, "device_mesh") and hasattr(t, "full_tensor")


def _ours(state_dict: dict, prefix: str) -> list[str]:
    """The keys of the module the hook runs for (the root, or a module nested under `prefix`)."""
    return [k for k in state_dict if k.startswith(prefix)]


class ShardedModuleState:
    """state_dict/load_state_dict hooks for an engine that replaced the module's parameters."""

    def __init__(self, engine: Engine, mirror: StateDictMirror, values: str):
        self.engine, self.mirror, self.values = engine, mirror, values
        self._mesh = None

    def install(self, module: nn.Module) -> None:
        module.register_state_dict_post_hook(partial(self._after_state_dict))  # partial: torch marks the hook
        module.register_load_state_dict_pre_hook(self._before_load)

    # -- state_dict ------------------------------------------------------------------------------
    def _after_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, _meta: Any) -> None:
        raw = {k: state_dict.pop(k) for k in _ours(state_dict, prefix)}  # what the module registers
        values = dict(self._values())
        for k in self.mirror.keys:
            state_dict[prefix + k.key] = raw[prefix + k.key] if k.module is not None else values[k.name]

    def _values(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(canonical name, value) of every parameter once, in the same order on every rank."""
        layout = self._layout()
        seen: set[str] = set()
        for k in self.mirror.keys:
            if k.module is None and k.name not in seen:
                seen.add(k.name)
                full = self._gather(k, layout.get(k.name, []))
                yield k.name, full.cpu() if self.values == "full" else self._sharded(full)

    def _layout(self) -> dict[str, list[tuple[torch.Tensor, ShardPiece]]]:
        """canonical name -> (flat view of the local Parameter, piece) for each piece this rank holds."""
        out: dict[str, list[tuple[torch.Tensor, ShardPiece]]] = {}
        for p, pieces in self.engine.shard_layout():
            for piece in pieces:
                out.setdefault(piece.name, []).append((p.detach().view(-1), piece))
        return out

    @torch.no_grad()
    def _gather(self, k: StateKey, pieces: list[tuple[torch.Tensor, ShardPiece]]) -> torch.Tensor:
        """The whole parameter on every rank: each rank's pieces, zeros elsewhere, summed (exact: every
        element is held once in the group whose ranks' pieces are disjoint, `grad_norm_group`)."""
        full = torch.zeros(k.shape.numel(), dtype=k.dtype, device=self.engine.device)
        for local, piece in pieces:
            full[piece.offset:piece.offset + piece.numel].copy_(local[piece.local_start:piece.local_start + piece.numel])
        if dist.is_initialized():
            collectives.all_reduce(full, group=self.engine.grad_norm_group)
        return full.view(k.shape)

    def _sharded(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's torch.chunk rows of `full` as a DTensor (Shard(0); a scalar: Replicate), a copy."""
        from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor

        if self._mesh is None:
            group = self.engine.group if self.engine.group is not None else dist.group.WORLD
            self._mesh = DeviceMesh.from_group(group, self.engine.device.type)
        placements = [Shard(0)] if full.dim() else [Replicate()]
        local = distribute_tensor(full, self._mesh, placements, src_data_rank=None).to_local()
        return DTensor.from_local(local.clone(), self._mesh, placements, run_check=False, shape=full.shape,
                                  stride=full.stride())

    # -- load_state_dict ---------------------------------------------------------------------------
    @torch.no_grad()
    def _before_load(self, module: nn.Module, state_dict: dict, prefix: str, _meta: Any, _strict: bool,
                     missing_keys: list[str], _unexpected: list[str], error_msgs: list[str]) -> None:
        registered = [(prefix + n, p) for n, p in module.named_parameters(remove_duplicate=False)]
        users = {prefix + k.key for k in self.mirror.keys if k.module is None}
        for key, p in registered:  # the engine's own keys first: the user's keys, loaded next, win
            value = state_dict.pop(key, None) if key not in users else None
            if value is not None and value is not p:
                self._copy_whole(key, p, value, error_msgs)
        given: dict[str, tuple[StateKey, torch.Tensor]] = {}
        missing = [prefix + k.key for k in self.mirror.keys if k.module is None and prefix + k.key not in state_dict]
        for k in self.mirror.keys:
            if k.module is None and prefix + k.key in state_dict:  # buffers stay in their modules: loaded as usual
                given[k.name] = (k, state_dict.pop(prefix + k.key))  # tied names: the last given wins
        missing_keys.extend(missing)
        if missing and _strict:
            error_msgs.append(f"{len(missing)} of the module's parameters are not in the state dict this rank was "
                              f"given ([Note: broadcast_from_rank0 on an engine that replaced the parameters]): "
                              "give every rank the whole state dict, e.g. set_model_state_dict(model, full, "
                              "options=StateDictOptions(full_state_dict=True)) or shardlab.load_full_state_dict")
        layout = self._layout()
        for name, (k, value) in given.items():
            self._load_param(prefix + k.key, k, value, layout.get(name, []), error_msgs)
        for key, p in registered:  # each loads onto itself (assign=True keeps the engine's Parameter)
            state_dict[key] = p

    def _load_param(self, key: str, k: StateKey, value: torch.Tensor,
                    pieces: list[tuple[torch.Tensor, ShardPiece]], error_msgs: list[str]) -> None:
        if _is_dtensor(value):
            value = value.full_tensor()  # a collective: every rank loads the same keys, in order
        if value.shape != k.shape:
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                              f"checkpoint, the shape in current model is {tuple(k.shape)}.")
            return
        flat = value.detach().reshape(-1)
        for local, piece in pieces:
            local[piece.local_start:piece.local_start + piece.numel].copy_(
                flat[piece.offset:piece.offset + piece.numel])

    @staticmethod
    def _copy_whole(key: str, p: torch.Tensor, value: torch.Tensor, error_msgs: list[str]) -> None:
        if value.shape != p.shape:
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                              f"checkpoint, the shape in current model is {tuple(p.shape)}.")
            return
        p.copy_(value)


class ModuleDTensorState:
    """torch-fsdp: FSDP2's state_dict as it is (DTensors); a plain tensor given to load_state_dict
    for a DTensor parameter is taken as the full value and sliced locally (no communication);
    values="full" gathers every DTensor (`full_tensor()`) into a CPU tensor."""

    def __init__(self, engine: Engine, values: str):
        self.engine, self.values = engine, values

    def install(self, module: nn.Module) -> None:
        if self.values == "full":
            module.register_state_dict_post_hook(partial(self._after_state_dict))  # partial: torch marks the hook
        module.register_load_state_dict_pre_hook(self._before_load)

    def _after_state_dict(self, _module: nn.Module, state_dict: dict, prefix: str, _meta: Any) -> None:
        for k in _ours(state_dict, prefix):
            v = state_dict[k]
            if _is_dtensor(v):
                v = v.to(self.engine.device) if v.device != self.engine.device else v  # offloaded shards
                state_dict[k] = v.full_tensor().cpu()

    @torch.no_grad()
    def _before_load(self, module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
        from torch.distributed.tensor import distribute_tensor

        for name, p in module.named_parameters(remove_duplicate=False):
            value = state_dict.get(prefix + name)
            if value is not None and _is_dtensor(p) and not _is_dtensor(value) and value.shape == p.shape:
                state_dict[prefix + name] = distribute_tensor(value.detach().to(self.engine.device), p.device_mesh,
                                                              p.placements, src_data_rank=None)


# [Note: a sharded engine's optimizer state under DCP]
# The optimizer keeps state per local Parameter, and DCP's get_state_dict names it by that
# Parameter's name; `dcp.save` keeps one copy of a name several ranks save (replicas). Two
# consequences for the from-scratch sharded engines, handled by hooks on the optimizer:
# - fsdp's (and fsdp-minimal's) Parameters are slices of one padded flat buffer per group, under
#   one name on every rank (`blocks.0.flat_shard`): every rank would resume with one rank's slice,
#   silently. So the optimizer's state_dict() gives a slice's state as a DTensor, Shard(0) of the
#   group's unpadded flat buffer over the ranks whose slices make it up (its torch.chunk rows are
#   exactly fsdp's slices), a view, so `dcp.load` writes through; load_state_dict takes a DTensor
#   back as the slice, padding zero. It reshards wherever the flat buffer is the same, which
#   fsdp's is at any world size.
# - zero3's are whole tensors under the user's names, each saved by its owner, but each rank's
#   param group lists other names: `dcp.save` keeps one rank's list, and DCP's set_state_dict then
#   gives the other ranks groups without their hyperparameters (lr, betas). Flattened optimizer
#   state dicts (`StateDictOptions(flatten_optimizer_state_dict=True)`, torchtitan's default)
#   save them per parameter instead; load_state_dict refuses a group that holds only its
#   parameters, naming that option, rather than train on without a learning rate.
# The optimizer is the user's, made after `parallelize`: its two hooks are added at its first step
# (a step pre-hook on every optimizer, registered once), which DCP's get/set_state_dict take
# themselves when the state is empty.

@dataclass(eq=False)
class FlatSlice:
    """A local Parameter that is rank `rank`'s torch.chunk slice of a flat buffer of `total`
    elements, sliced over `group`."""

    group: Any
    rank: int
    total: int
    device_type: str
    mesh: Any = None                           # DeviceMesh over `group`, made at first use

    def valid(self, numel: int) -> int:
        return max(0, min(numel, self.total - self.rank * numel))

    def dtensor(self, value: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DeviceMesh, DTensor, Shard

        if self.mesh is None:
            self.mesh = DeviceMesh.from_group(self.group, self.device_type)
        return DTensor.from_local(value.view(-1)[:self.valid(value.numel())], self.mesh, [Shard(0)],
                                  run_check=False, shape=torch.Size([self.total]), stride=(1,))


# id(Parameter) -> (the Parameter, its FlatSlice or None for a whole tensor) of every sharded engine
_SHARDED: dict[int, tuple[weakref.ref, FlatSlice | None]] = {}
_HOOKED: weakref.WeakSet = weakref.WeakSet()           # optimizers seen at a step
_STEP_HOOK: list = []


def _entry(p: torch.Tensor) -> tuple[bool, FlatSlice | None]:
    """(whether `p` is a sharded engine's local Parameter, its FlatSlice if it is a slice)."""
    ref, info = _SHARDED.get(id(p), (None, None))
    return (True, info) if ref is not None and ref() is p else (False, None)


def register_local_parameters(engine: Engine) -> None:
    """Record a sharded engine's local Parameters, and which are slices of a flat buffer ([Note: a
    sharded engine's optimizer state under DCP]). An engine with such slices lists them as
    `groups`, each with its `shard` (the Parameter) and `entries` (what the buffer holds, unpadded);
    this asks nothing of the other ranks, so it runs as well under plan's fake probes."""
    group = engine.grad_norm_group if engine.grad_norm_group is not None else dist.group.WORLD
    slices: dict[int, FlatSlice] = {}
    if dist.is_initialized():
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        for g in getattr(engine, "groups", ()):
            shard, entries = getattr(g, "shard", None), getattr(g, "entries", None)
            if shard is None or entries is None:
                continue
            total = sum(e.numel for e in entries)
            if shard.numel() == -(-total // size):  # torch.chunk's rows: else DCP's layout would not be this one
                slices[id(shard)] = FlatSlice(group, rank, total, engine.device.type)
    for p, _ in engine.shard_layout():
        _SHARDED[id(p)] = (weakref.ref(p, _forget(id(p))), slices.get(id(p)))
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_hook_optimizer))


def _forget(key: int) -> Any:
    """A Parameter's entry goes with it (its id may be reused)."""
    return lambda ref: _SHARDED.pop(key, None) if _SHARDED.get(key, (None,))[0] is ref else None


def _hook_optimizer(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    if optimizer in _HOOKED:
        return
    _HOOKED.add(optimizer)
    if any(_entry(p)[0] for g in optimizer.param_groups for p in g["params"]):
        optimizer.register_state_dict_post_hook(_optimizer_state_out)
        optimizer.register_load_state_dict_pre_hook(_optimizer_state_in)


def _optimizer_state_out(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    params = [p for g in optimizer.param_groups for p in g["params"]]  # state_dict's ids count them in order
    for pid, st in list(state_dict["state"].items()):
        info = _entry(params[pid])[1]
        if info is not None:  # a new dict: `st` is the optimizer's own
            state_dict["state"][pid] = {k: info.dtensor(v) if isinstance(v, torch.Tensor) and v.shape == params[pid].shape
                                        else v for k, v in st.items()}


def _optimizer_state_in(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    for i, g in enumerate(state_dict["param_groups"]):
        if set(g) <= {"params", "param_names"} and set(optimizer.param_groups[i]) - {"params", "param_names"}:
            raise ValueError(f"optimizer state dict: param group {i} holds its parameters and none of its "
                             "hyperparameters (lr, ...): under a sharded engine each rank's optimizer holds other "
                             "parameters, and dcp.save kept one rank's list of them. Save and load the optimizer "
                             "with torch.distributed.checkpoint.state_dict's StateDictOptions("
                             "flatten_optimizer_state_dict=True)")
    saved = [i for g in state_dict["param_groups"] for i in g["params"]]
    param_of = dict(zip(saved, [p for g in optimizer.param_groups for p in g["params"]]))
    state = {}
    for key, st in state_dict["state"].items():
        p = param_of.get(key)
        state[key] = {k: _as_slice(v, p) for k, v in st.items()} if p is not None else st
    return {**state_dict, "state": state}


def _as_slice(value: Any, p: torch.Tensor) -> Any:
    if not _is_dtensor(value):
        return value
    local = value.to_local().reshape(-1)
    out = torch.zeros(p.numel(), dtype=local.dtype, device=local.device)
    out[:local.numel()] = local
    return out.view(p.shape)
