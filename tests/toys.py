"""A toy engine and a toy model, registered from outside src/ the way docs/architecture.md says
("Extending shardlab"): one class and one registry line each. tests/test_extending.py uses them;
SHARDLAB_PLUGINS=tests.toys makes every process a run starts (workers, plan's probes, bench's
cells) import this module with shardlab, so the entries exist there too.

It imports no shardlab.config: a plugin registers before config builds the `model:` section.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardlab.engines import STRATEGIES, EngineEntry, collectives
from shardlab.engines import _hooks as hooks
from shardlab.engines.api import Engine, materialize_whole_
from shardlab.engines.measuring import Measurable
from shardlab.engines.planning import Collective, Plannable
from shardlab.models import MODELS, ModelSpec
from shardlab.models.init import init_parameters_


class ToyEngine(Engine, Plannable, Measurable):
    """Replicated, as plain as data parallelism gets: every rank holds the whole model; after the
    last node of each synced backward all gradients travel in one flat all-reduce (averaged)."""

    def __init__(self, module: nn.Module, **kw: Any):
        super().__init__(module, **kw)
        materialize_whole_(module, self.device)
        self.counter = collectives.CommCounter()
        hooks.broadcast_from_rank0([*module.parameters(), *module.buffers()], self.group, self.counter)
        self._backward_end = hooks.BackwardEnd(self._reduce)
        for p in self.local_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hooks.weak_hook(self._arm))

    def _arm(self, _param: torch.Tensor) -> None:
        if self.sync_grads:  # inside no_sync the gradients accumulate locally
            self._backward_end.arm()

    @torch.no_grad()
    def _reduce(self) -> None:
        grads = [p.grad for p in self.local_parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        collectives.all_reduce(flat, self.group, average=True, counter=self.counter)
        for g, value in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(value.view_as(g))

    def comm_counters(self) -> list[collectives.CommCounter]:
        return [self.counter]

    @classmethod
    def step_traffic(cls, model, options) -> list[Collective]:
        return [Collective("all_reduce", model.trainable_bytes, 1, model.world)]


class ToyNet(nn.Module):
    """Two tanh blocks (the wrap units) and a linear head; forward(x, targets) returns the loss."""

    def __init__(self, seed: int = 0, width: int = 16, in_features: int = 8, classes: int = 4):
        super().__init__()
        self.init_seed = seed
        self.blocks = nn.ModuleList([nn.Linear(in_features, width), nn.Linear(width, width)])
        self.head = nn.Linear(width, classes)
        if self.head.weight.device.type != "meta":
            init_parameters_(self, seed)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        out = self.head(x)
        return out if targets is None else F.cross_entropy(out.float(), targets)


STRATEGIES["toy"] = EngineEntry("tests.toys:ToyEngine", torch_twin="torch-ddp")
MODELS["toy"] = ModelSpec(name="toy", data_kind="vectors", build=lambda section, seed, vocab: ToyNet(seed),
                          record=lambda model: {}, rebuild=lambda kwargs, seed: ToyNet(seed),
                          synthetic=lambda section: {"in_features": 8, "num_classes": 4})
