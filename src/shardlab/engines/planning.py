"""What `shardlab plan` asks of an engine, without training with it: `Plannable`, its types
(`LocalTensor`, `ModelTraffic`, `Collective`) and the traffic formulas engines share. Every
engine class composes it beside `Engine` (docs/architecture.md, "The engine contract").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

from torch import nn


class HoldsParameters(Protocol):
    """What `Plannable` and `Measurable` need of the engine they are composed with: the
    tensors this rank holds (`Engine.local_parameters`). It is the type of `self` in the
    defaults that read them, so the dependency is declared rather than guessed."""

    def local_parameters(self) -> list[nn.Parameter]:
        """What this rank holds and its optimizer updates (deduplicated)."""
        ...


class LocalTensor(NamedTuple):
    """One tensor a rank keeps between steps, as plan counts its model state: elements,
    bytes per element, and whether it trains (then it has a gradient and optimizer state)."""

    numel: int
    element_size: int
    trainable: bool


@dataclass(frozen=True)
class ModelTraffic:
    """What an engine's traffic per step depends on, measured on the (meta) model: parameter
    bytes in the dtype they are communicated in, and the wrap units."""

    param_bytes: float          # every parameter
    trainable_bytes: float      # those that get a gradient
    root_bytes: float           # those outside every wrap unit (the root's own)
    units: int                  # wrap units, the root not counted
    micro_batches: int          # forward/backward passes per rank per step
    world: int
    tensors: int                # parameter tensors (tied names counted once): per-tensor collectives' calls
    trainable_tensors: int      # those that get a gradient


class Collective(NamedTuple):
    """One kind of collective in a step: its full (unsharded) bytes per call, calls per step,
    and ranks in the group it runs over."""

    kind: str
    nbytes: float
    calls: int
    ranks: int


def bucketed_all_reduce(model: ModelTraffic, bucket_bytes: int) -> list[Collective]:
    """DDP's traffic: every trainable gradient all-reduced once per step, in buckets."""
    calls = max(1, math.ceil(model.trainable_bytes / bucket_bytes))
    return [Collective("all_reduce", model.trainable_bytes / calls, calls, model.world)]


def gathered_unit_traffic(model: ModelTraffic, gather: str, reduce: str, group: int, *,
                          root_kept: bool, accumulate: str = "local") -> list[Collective]:
    """A sharded engine's traffic: every unit (the root one of them) gathered for forward at
    every micro batch and again for backward (`root_kept`: the root stays gathered between the
    two, so it is not gathered again), and its gradients reduced once per step (`accumulate`
    "sharded": once per micro batch, [Note: sharded accumulation] in engines/api.py), all within a
    group of `group` ranks; with hybrid sharding (group < world) each unit's reduced 1/group
    slice is then all-reduced across the world/group replicas, as often."""
    n = model.units + 1
    again = n - 1 if root_kept else n
    reduces = n * (model.micro_batches if accumulate == "sharded" else 1)
    out = [Collective(gather, model.param_bytes / n, n * model.micro_batches, group),
           Collective(gather, (model.param_bytes - (model.root_bytes if root_kept else 0)) / max(1, again),
                      again * model.micro_batches, group),
           Collective(reduce, model.trainable_bytes / n, reduces, group)]
    if group < model.world:
        out.append(Collective("all_reduce", model.trainable_bytes / n / group, reduces, model.world // group))
    return out


class Plannable:
    """Plan's questions, with the answers of a replicated engine (every rank holds every
    tensor whole, nothing is sent) as defaults; an engine overrides where it differs. Composed
    with `Engine`, whose `local_parameters` the built engine's answer reads (`HoldsParameters`)."""

    #: False when plan cannot probe the engine on real tensors on a fake process group, whose
    #: collectives return at once without peers (the future of PyTorch DDP's all-reduce hook needs a
    #: real one); plan's real-tensor probe then runs it on a real one-rank group, which is exact only
    #: when a rank's memory does not depend on N. Fake-tensor probes always run on the fake group.
    fake_group_probe: ClassVar[bool] = True
    #: False when plan cannot run the engine's step under FakeTensorMode (plan/probe.py, [Note:
    #: fake-tensor probes]); plan then probes it on real tensors at a reduced micro batch.
    fake_tensor_probe: ClassVar[bool] = True
    #: True when a rank's layout changes with the model's depth in a way no cut model has (which
    #: rank owns which whole tensor), so a probe cut to a few blocks cannot be scaled to the real
    #: depth: plan's fake-tensor probe then runs the model whole ([Note: scaling a probe's peak to
    #: the real depth] in plan/scaling.py).
    probe_whole_depth: ClassVar[bool] = False

    @classmethod
    def planned_state(cls, params: list[nn.Parameter], world: int, options: Mapping[str, Any]
                      ) -> list[list[LocalTensor]] | None:
        """The tensors each rank keeps between steps (its local parameters), by the engine's rule,
        without building it: `params` are the model's unique parameters (on the meta device),
        `options` the engine's. One list per distinct rank (plan takes the largest). None when
        only building the engine tells: plan then builds it on the meta device on a fake
        process group of `world` ranks, at the ranks `planned_ranks(world)`, and asks
        `rank_states()`."""
        return [[LocalTensor(p.numel(), p.element_size(), p.requires_grad) for p in params]]

    @classmethod
    def planned_ranks(cls, world: int) -> list[int]:
        """The ranks plan builds the engine at when `planned_state` says None (the largest state
        is taken over what they report)."""
        return [0]

    def rank_states(self: HoldsParameters) -> list[list[LocalTensor]]:
        """What a built engine knows of the ranks' local tensors: by default this rank's own."""
        return [[LocalTensor(p.numel(), p.element_size(), p.requires_grad) for p in self.local_parameters()]]

    @classmethod
    def step_traffic(cls, model: ModelTraffic, options: Mapping[str, Any]) -> list[Collective]:
        """The collectives one training step issues, by design (docs/engines.md), for the time
        model of `shardlab plan`."""
        return []
