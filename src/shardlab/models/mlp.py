"""A plain MLP: a stack of Linear layers with GELU between them, for tests and toy runs.
Shapes like (7, 15) and (15, 3) make some ranks' shards empty, on purpose."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from shardlab.errors import ConfigError
from shardlab.models.init import init_parameters_
from shardlab.models.spec import ModelSpec


class MLPModel(nn.Module):
    """forward(x, targets=None) -> outputs, or the mean cross-entropy when targets are given."""

    def __init__(self, sizes: tuple[int, ...] = (7, 15, 3), seed: int = 0):
        super().__init__()
        if len(sizes) < 2:
            raise ValueError("an MLP needs at least an input and an output size")
        self.sizes = tuple(sizes)
        self.init_seed = seed
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        if self.layers[0].weight.device.type != "meta":
            init_parameters_(self, seed)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x if targets is None else F.cross_entropy(x.to(torch.promote_types(x.dtype, torch.float32)), targets)


# -- registry entry (shardlab.models.MODELS) -------------------------------------------------------
@dataclass
class MLPKeys:
    """`model.*` keys of model.name=mlp."""

    mlp_sizes: list[int] = field(default_factory=lambda: [32, 64, 10])  # input, hidden..., classes


def _check(section) -> None:
    if len(section.mlp_sizes) < 2 or any(s < 1 for s in section.mlp_sizes):
        raise ConfigError(f"model.mlp_sizes must list at least an input and an output size (>= 1), "
                          f"got {section.mlp_sizes}")


SPEC = ModelSpec(
    name="mlp", keys=MLPKeys, data_kind="vectors",
    build=lambda section, seed, vocab: MLPModel(tuple(section.mlp_sizes), seed=seed),
    record=lambda model: {"sizes": list(model.sizes)},
    rebuild=lambda kwargs, seed: MLPModel(tuple(kwargs["sizes"]), seed=seed),
    check=_check,
    synthetic=lambda section: {"in_features": section.mlp_sizes[0], "num_classes": section.mlp_sizes[-1]})
