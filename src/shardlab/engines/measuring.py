"""What a run's measurements ask of an engine while it trains: `Measurable` (the buffers it
holds in flight, the gradients it lets the live-memory tracker claim, the state it keeps, what
its collectives counted), the tracker's side of that exchange (`MemoryTracking`) and the
optimizer's state bytes. Every engine class composes `Measurable` beside `Engine`
(docs/architecture.md, "The engine contract").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

from shardlab.engines.collectives import CommCounter, merged_seconds, merged_totals
from shardlab.engines.planning import HoldsParameters


class MemoryTracking(Protocol):
    """What the live-memory tracker (shardlab.memory.LiveMemoryTracker) offers an engine."""

    tracking: bool              # a step is being tracked now

    def hook_leaf(self, leaf: torch.Tensor, part: str) -> None:
        """Claim as `part` the gradient autograd accumulates into `leaf`, after the engine's hooks."""

    def hook_incoming(self, leaf: torch.Tensor, part: str) -> None:
        """Claim as `part` the gradient flowing into `leaf`, before AccumulateGrad and its hooks."""

    def keep_handle(self, handle: Any) -> None:
        """Remove `handle` (a hook the engine registered for the tracker) when the tracker closes."""


class Measurable:
    """The measurements' questions, with the answers of an engine that holds nothing in flight
    and counts nothing as defaults; an engine overrides where it differs. Composed with
    `Engine`, whose `local_parameters` the state bytes read (`HoldsParameters`)."""

    def memory_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(part, tensor) for the transient buffers this engine holds right now, by the part
        names of shardlab.memory ("gathered_params", "unsharded_grads", "comm", "grads"), for
        the live-memory tracker. Read-only. Local parameters, their `.grad` and optimizer state
        are not listed (the tracker reads them directly)."""
        return iter(())

    def hook_memory_tracker(self, tracker: MemoryTracking) -> None:
        """Let `tracker` claim the gradients autograd delivers to the leaves this engine makes
        (gathered parameters), the moment they arrive ([Note: a gradient is a gradient from
        birth], shardlab/memory.py). Called when the tracker starts and at every step's end
        (leaves made since); a leaf already hooked is skipped by the tracker."""

    def model_state_bytes(self: HoldsParameters) -> dict[str, int]:
        """Bytes of parameters and gradients this rank holds now (tensors the engine keeps
        between steps; transient gathered buffers excluded)."""
        params = self.local_parameters()
        return {"params": sum(nbytes(p) for p in params),
                "grads": sum(nbytes(p.grad) for p in params if p.grad is not None)}

    def comm_counters(self) -> list[CommCounter]:
        """The counters this engine's collectives add to (engines/collectives.py); none: not counted."""
        return []

    def comm_stats(self) -> dict[str, dict[str, int]] | None:
        """Bytes per collective kind since wrap, when the engine counts them."""
        counters = self.comm_counters()
        return merged_totals(counters) if counters else None

    def comm_seconds(self) -> dict[str, float] | None:
        """Seconds per collective kind since wrap, when the engine times them (what is timed:
        engines/collectives.py's docstring)."""
        counters = self.comm_counters()
        return merged_seconds(counters) if counters else None


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer's state tensors on this rank (a DTensor's local shard), scalars left out."""
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                local = v.to_local() if hasattr(v, "to_local") else v
                total += nbytes(local)
    return total
