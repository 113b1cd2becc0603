"""Test-only engines and models with known faults, for tests/test_verify.py: each is a small
subclass of the real thing, registered in a worker process only (`use`), so verify meets them
through the config exactly as it meets the user's own code."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from shardlab.engines import STRATEGIES, EngineEntry
from shardlab.engines import collectives as C
from shardlab.engines.ddp import DDPEngine
from shardlab.models import MODELS
from shardlab.models.mlp import MLPModel

FAULTY_PARAMETER = "layers.1.weight"   # the parameter the faults below touch (an MLP's second layer)


class SkipAveragingDDP(DDPEngine):
    """DDP that sums each bucket over the ranks and divides afterwards, except that rank 1
    skips the division for the bucket holding FAULTY_PARAMETER: its copy is N times the mean."""

    def __init__(self, module, **kw):
        super().__init__(module, **kw)
        names = {id(p): n for n, p in self.unwrapped().named_parameters()}
        self._faulty = {id(b) for b in self.buckets if any(names[id(p)] == FAULTY_PARAMETER for p in b.params)}

    def _launch(self, bucket) -> None:
        bucket.handle = C.all_reduce(bucket.buffer, self.group, average=False, async_op=True, counter=self.counter)
        bucket.launched = True
        self._next_to_launch += 1

    @torch.no_grad()
    def _finish_backward(self) -> None:
        super()._finish_backward()  # waits; the gradients are views of the bucket buffers
        for bucket in self.buckets:
            if not (self.rank == 1 and id(bucket) in self._faulty):
                bucket.buffer.div_(self.world_size)


class FrozenGetsZeroGradDDP(DDPEngine):
    """DDP that hands every frozen parameter a zero gradient before clipping: AdamW's weight
    decay then moves parameters that requires_grad=False says must stay put."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        for p in self.local_parameters():
            if not p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        return super().clip_grad_norm_(max_norm, norm_type)


class SumLossMLP(MLPModel):
    """An MLP whose loss is the sum over its micro batch's samples, not their mean."""

    def forward(self, x, targets=None):
        out = super().forward(x)
        return out if targets is None else F.cross_entropy(out, targets, reduction="sum")


class Float32IslandMLP(MLPModel):
    """An MLP whose hidden activations pass through a float32 buffer (an in-place copy, which
    verify's float64 mode cannot keep in float64): rounding, not a fault, at 3 ranks."""

    def forward(self, x, targets=None):
        h = F.gelu(self.layers[0](x))
        staging = torch.empty(h.shape, dtype=torch.float32)
        staging.copy_(h)
        out = self.layers[1](staging.to(h.dtype))
        return out if targets is None else F.cross_entropy(out, targets)


def _mlp_sizes(section) -> tuple[int, ...]:
    return tuple(section.mlp_sizes)


def _frozen_mlp(section, seed, vocab):
    model = MLPModel(_mlp_sizes(section), seed=seed)
    model.layers[1].requires_grad_(False)
    return model


def _sum_loss_mlp(section, seed, vocab):
    return SumLossMLP(_mlp_sizes(section), seed=seed)


ENGINES = {"skip-averaging": "tests.verify_faults:SkipAveragingDDP",
           "frozen-zero-grad": "tests.verify_faults:FrozenGetsZeroGradDDP"}
def _island_mlp(section, seed, vocab):
    return Float32IslandMLP(_mlp_sizes(section), seed=seed)


MODEL_BUILDS = {"frozen": _frozen_mlp, "sum-loss": _sum_loss_mlp, "float32-island": _island_mlp}
_ORIGINAL = (dict(STRATEGIES), dict(MODELS))


def use(engine: str | None = None, model: str | None = None) -> None:
    """In this process: `ddp` is the faulty engine `engine`, `mlp` builds the faulty model `model`
    (None: the real ones)."""
    STRATEGIES.update(_ORIGINAL[0])
    MODELS.update(_ORIGINAL[1])
    if engine is not None:
        STRATEGIES["ddp"] = EngineEntry(ENGINES[engine])
    if model is not None:
        MODELS["mlp"] = dataclasses.replace(MODELS["mlp"], build=MODEL_BUILDS[model])
