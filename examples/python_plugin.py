"""A model of your own for the `shardlab` command, with its own `model.*` keys (docs/python.md,
"3. A model for the CLI"): one class and one registry line, as the catalogue's own models.

    SHARDLAB_PLUGINS=python_plugin PYTHONPATH=examples \
        shardlab train --nproc 2 model.name=wide-mlp model.wide_width=48 data.source=synthetic

Every `shardlab` command then knows `model.name=wide-mlp`: train, verify, plan, bench, export.
The module registers before anything imports shardlab.config, whose `model:` section is built
from the registry once: SHARDLAB_PLUGINS has `import shardlab` import it first.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardlab.models import MODELS, ModelSpec


@dataclass
class WideKeys:
    wide_width: int = 64  # model.wide_width: the hidden width
    wide_depth: int = 2   # model.wide_depth: hidden layers


class WideMLP(nn.Module):
    """16 features in, 4 classes out; forward(inputs, targets) returns the mean loss."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.width, self.depth = width, depth
        sizes = [16] + [width] * depth
        self.blocks = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))  # the engines' wrap units
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = F.relu(block(x))
        logits = self.head(x)
        return logits if targets is None else F.cross_entropy(logits.float(), targets)


MODELS["wide-mlp"] = ModelSpec(
    name="wide-mlp", keys=WideKeys, data_kind="vectors",
    build=lambda section, seed, vocab_size: WideMLP(section.wide_width, section.wide_depth),
    record=lambda model: {"width": model.width, "depth": model.depth},      # kept in each checkpoint
    rebuild=lambda kwargs, seed: WideMLP(kwargs["width"], kwargs["depth"]),  # export, eval
    synthetic=lambda section: {"in_features": 16, "num_classes": 4},        # data.source=synthetic's shape
)
