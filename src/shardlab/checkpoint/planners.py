"""What a rank holds and how DCP writes and reads it: each original parameter (and its
optimizer state) as a flattened 1-D tensor, of which each rank saves or loads the ranges it holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardlab.checkpoint.format import CheckpointError
from shardlab.engines.api import ShardPiece, engine_of


# ============================================================================ what a rank holds
def _flat_local(t: torch.Tensor) -> torch.Tensor:
    """The 1-D view of the elements this rank stores for `t` (a DTensor's local shard), sharing
    storage, detached: DCP loads in place through it."""
    t = t.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.view(-1)


def checkpoint_layout(model: nn.Module) -> list[tuple[nn.Parameter, list[ShardPiece]]]:
    """For each local (optimizer-visible) parameter, the contiguous pieces of original parameters
    it holds, in flattened-element offsets (see ShardPiece): each engine's `shard_layout()`."""
    return engine_of(model).shard_layout()


def _persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, m in module.named_modules():
        for attr, b in m._buffers.items():
            if b is not None and attr not in m._non_persistent_buffers_set:
                yield (f"{mod_name}.{attr}" if mod_name else attr), b


def _model_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers by state_dict name. Every engine keeps them replicated in the user's modules."""
    out = {}
    for name, b in _persistent_buffers(engine_of(model).unwrapped()):
        if b.numel() and b.untyped_storage().nbytes() < b.numel() * b.element_size():
            raise CheckpointError(f"buffer {name!r} has no storage between steps in the "
                                  f"{engine_of(model).strategy} engine; checkpointing it is not supported")
        out[name] = b.detach()
    return out



# ============================================================================ DCP planners
@dataclasses.dataclass
class _Piece:
    """One contiguous range of a flattened tensor `fqn` (of full_numel elements) on this rank."""

    fqn: str
    offset: int
    full_numel: int
    data: torch.Tensor  # 1-D, numel elements, a view into the live tensor (or a staged copy)


class _FlatPieceSavePlanner(DefaultSavePlanner):
    """The default planner for ordinary entries, plus one SHARD write item per flat piece.

    [Note: why a planner and not ShardedTensor/DTensor] A piece is an arbitrary contiguous
    range: FSDP flat shards cut parameters anywhere and ZeRO-3 owns whole tensors. DTensor
    can only express torch.chunk-style even splits; ShardedTensor is deprecated and needs
    one collective per tensor to build. DCP's own chunk metadata (offsets, sizes) expresses
    the ranges directly, and its global-plan validation checks that the chunks of every
    tensor cover it exactly once, so a wrong layout fails the save instead of writing garbage.
    """

    def __init__(self, pieces: list[_Piece]):
        super().__init__()
        self.pieces = {(p.fqn, p.offset): p for p in pieces}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for p in self.pieces.values():
            items.append(WriteItem(
                index=MetadataIndex(p.fqn, torch.Size([p.offset])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size([p.offset]), sizes=torch.Size([p.data.numel()])),
                    properties=TensorProperties.create_from_tensor(p.data),
                    size=torch.Size([p.full_numel])),
            ))
        mappings = dict(plan.planner_data or {})
        mappings.update({p.fqn: (p.fqn,) for p in self.pieces.values()})
        self.plan = dataclasses.replace(plan, items=plan.items + items, planner_data=mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        index = write_item.index
        if write_item.type == WriteItemType.SHARD and index.offset is not None and len(index.offset) == 1:
            piece = self.pieces.get((index.fqn, index.offset[0]))
            if piece is not None:
                return piece.data
        return super().resolve_data(write_item)


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, minus the one path that unpickles freely: a "bytes" entry is
    read by `torch.load(weights_only=False)`. shardlab saves tensors only, and `SafeReader`
    already refuses metadata that declares bytes entries; this refuses them a second time."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object, which shardlab "
                              "never saves; refusing to unpickle it (the checkpoint was not written by shardlab)")


class _FlatPieceLoadPlanner(TensorOnlyLoadPlanner):
    """Reads each flat piece this rank holds from whichever saved chunks overlap it (resharding)."""

    def __init__(self, pieces: list[_Piece]):
        super().__init__()
        self.pieces = {(p.fqn, p.offset): p for p in pieces}

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for p in self.pieces.values():
            md = self.metadata.state_dict_metadata.get(p.fqn)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != (p.full_numel,):
                raise CheckpointError(f"checkpoint entry {p.fqn!r} is {getattr(md, 'size', 'missing')}, "
                                      f"expected a flat tensor of {p.full_numel} elements")
            chunk = ChunkStorageMetadata(offsets=torch.Size([p.offset]), sizes=torch.Size([p.data.numel()]))
            items += create_read_items_for_chunk_list(p.fqn, md, [chunk])
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is not None and len(index.offset) == 1:
            piece = self.pieces.get((index.fqn, index.offset[0]))
            if piece is not None:
                return piece.data
        return super().lookup_tensor(index)
