"""Deterministic, name-keyed parameter initialization.

[Note: why every tensor has its own generator]
A sharded engine builds the model on the meta device and materializes one unit at a
time, so no rank ever holds the whole model. For that unit to equal the same unit of a
model built whole in one process, a tensor's initial values must not depend on the order
in which tensors are created or on which device they live. So each tensor is drawn from
a CPU generator seeded by (seed, the tensor's canonical name in the root model). Tied
parameters resolve to one canonical name (the first under which `named_parameters`
lists them), so they get one value whichever module reaches them first.

[Note: models that fill their own tensors]
A model whose values come from elsewhere (pretrained weights in safetensors files, a library's
own init scheme: `models/hf.py`) defines `shardlab_initialize_(modules, names)` on its root.
`init_parameters_` then hands the call over, with the same arguments, so every engine's
materialization (whole, unit by unit, owned tensors only) fills that model correctly without
knowing it. It must fill the parameters with storage of those modules and their buffers
(buffers computed at construction included), and leave meta tensors alone.

Such a model may also define `shardlab_range_readers(params, names)`: for the parameters it can
read piecewise, id(p) -> read(start, end) giving elements [start, end) of p flattened. An
engine that keeps only a flat range of each parameter (fsdp) leaves those on the meta device
and reads just its ranges, never the whole tensor; it materializes and initializes the rest.
torch-fsdp reads each DTensor shard's rows the same way (engines/native.py, `_materialize_sharded_`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable

import torch
from torch import nn

# Models may set this attribute on a Linear to scale its init (GPT-2's residual projections).
INIT_STD_ATTR = "_shardlab_init_std"
DEFAULT_STD = 0.02
# A root model with this method fills its own tensors (see the Note above).
INITIALIZER_ATTR = "shardlab_initialize_"
# ... and with this one reads element ranges of some of them (see the same Note).
RANGE_READERS_ATTR = "shardlab_range_readers"


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))
    return g


def _init_value(module: nn.Module, local_name: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    if isinstance(module, (nn.LayerNorm, nn.modules.batchnorm._BatchNorm, nn.GroupNorm)):  # SyncBatchNorm too
        return torch.ones(shape) if local_name == "weight" else torch.zeros(shape)
    if local_name == "bias":
        return torch.zeros(shape)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        fan_out = shape[0] * math.prod(shape[2:])  # kaiming normal, fan_out, relu
        return torch.randn(shape, generator=g) * math.sqrt(2.0 / fan_out)
    std = getattr(module, INIT_STD_ATTR, DEFAULT_STD)
    return torch.randn(shape, generator=g) * std


def canonical_names(root: nn.Module) -> dict[int, str]:
    """id(parameter) -> the name `root.named_parameters()` gives it (first owner wins for tied ones)."""
    return {id(p): n for n, p in root.named_parameters()}


@torch.no_grad()
def init_parameters_(root: nn.Module, seed: int, modules: Iterable[nn.Module] | None = None,
                     names: dict[int, str] | None = None) -> None:
    """Initialize (in place) the parameters and buffers of `modules` (default: all of `root`).

    Parameters must already have storage (call `to_empty` first for meta modules). `names`
    lets an engine pass canonical names computed before it replaced any parameter.
    """
    custom = getattr(root, INITIALIZER_ATTR, None)
    if custom is not None:  # see [Note: models that fill their own tensors]
        custom(modules=None if modules is None else list(modules), names=names)
        return
    names = names if names is not None else canonical_names(root)
    wanted = None if modules is None else {id(m) for m in modules}
    for module in root.modules():
        if wanted is not None and id(module) not in wanted:
            continue
        for local_name, p in module.named_parameters(recurse=False):
            full = names[id(p)]
            value = _init_value(module, local_name, p.shape, _generator(seed, full))
            copy_full_value_(p, value)
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            module.running_mean.zero_()
            module.running_var.fill_(1.0)
            module.num_batches_tracked.zero_()


def dtensor_local_rows(p: torch.Tensor) -> tuple[int, torch.Size]:
    """(first row, local shape) of a DTensor placed Shard(0) and/or Replicate (FSDP2's, HSDP's):
    its local shard is rows [first, first + shape[0]) of the whole tensor, i.e. one contiguous
    range of the flattened tensor. Any other placement raises ValueError."""
    # deferred: torch.distributed.tensor costs 0.5 s to import; only FSDP2's DTensors come here
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0) for pl in p.placements):
        raise ValueError(f"placements {p.placements}: only Shard(0) and Replicate map onto contiguous ranges of "
                         "the flattened tensor")
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # shapes only; the mesh's coordinates are host tensors (plan's fake probes)
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return (offset[0] if p.dim() else 0), torch.Size(shape)


def copy_full_value_(p: torch.Tensor, value: torch.Tensor) -> None:
    """Write a parameter's full initial value into it; a DTensor (FSDP2's sharded parameters)
    takes only the rows its local shard holds, so a model sharded on the meta device and
    materialized there equals one built whole."""
    if not hasattr(p, "device_mesh"):
        p.copy_(value.to(dtype=p.dtype))
        return
    first, shape = dtensor_local_rows(p)
    local = p.to_local()
    if local.numel():
        local.copy_((value[first:first + shape[0]] if p.dim() else value).to(dtype=local.dtype))


def parameter_bindings(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, attribute) that binds it, in module order."""
    seen: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for local_name, p in module.named_parameters(recurse=False):
            seen.setdefault(id(p), []).append((module, local_name))
    return seen


def tied_parameters(root: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that share one Parameter, e.g. GPT's embedding and head."""
    return [group for group in parameter_bindings(root).values() if len(group) > 1]


def to_empty_keeping_ties_(root: nn.Module, device: str | torch.device) -> nn.Module:
    """`Module.to_empty`, which unties shared parameters, with the ties restored."""
    ties = tied_parameters(root)
    root.to_empty(device=device)
    for (m0, n0), *rest in ties:
        for m, n in rest:
            setattr(m, n, getattr(m0, n0))
    return root


@torch.no_grad()
def materialize_(root: nn.Module, device: str | torch.device, seed: int) -> nn.Module:
    """Give a meta-device model real storage on `device` and initialize it exactly as a
    model built there directly (ties kept)."""
    to_empty_keeping_ties_(root, device)
    init_parameters_(root, seed)
    return root
