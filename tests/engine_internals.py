"""What the engine tests read of an engine's insides, and nothing in src/ asks: gathered storage
held now, fsdp's traffic by process group. Each takes the engine."""

from __future__ import annotations

from torch import nn

from shardlab.engines.collectives import merged_totals
from shardlab.engines.fsdp import FSDPEngine
from shardlab.engines.zero3 import Zero3Engine


def gathered_bytes(engine, module: nn.Module | None = None) -> int:
    """Bytes of full (gathered) parameter storage the engine holds now, as its `memory_buffers()`
    name it (0 between steps when it reshards); for zero3, of the unit whose module is `module`
    when given."""
    if module is not None:
        assert isinstance(engine, Zero3Engine), type(engine).__name__
        return sum(b.untyped_storage().nbytes() for g in engine._live if g.unit.module is module for b in g.buffers)
    return sum(t.untyped_storage().nbytes() for part, t in engine.memory_buffers() if part == "gathered_params")


def comm_stats_by_group(engine: FSDPEngine) -> dict[str, dict[str, dict[str, int]]]:
    """fsdp's counts split by the group each collective ran over: "shard" (also the wrap-time
    broadcast of buffers, over the whole group) and "replicate" (HSDP only)."""
    return {"shard": merged_totals([engine.counter]), "replicate": merged_totals([engine.replica_counter])}

