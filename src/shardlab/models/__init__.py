"""Model registry: `build_model(name, ...)` for the names the config accepts.

Every model's forward is `forward(inputs, targets=None)` and returns the mean loss when
targets are given, so the training loop and the engines never look inside a model.
`repeated_blocks(model)` names the units an engine wraps by default.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlab.models.gpt import GPT, GPT_PRESETS, GPTConfig
from shardlab.models.init import canonical_names, init_parameters_
from shardlab.models.mlp import MLPModel
from shardlab.models.resnet import ResNet

__all__ = ["GPT", "GPTConfig", "GPT_PRESETS", "MLPModel", "ResNet", "MODEL_NAMES", "build_model",
           "repeated_blocks", "init_parameters_", "canonical_names", "count_parameters"]

MODEL_NAMES: tuple[str, ...] = ("gpt", "resnet", "mlp")


def build_model(name: str, *, seed: int = 0, device: str | torch.device = "cpu", **kw) -> nn.Module:
    """Build a model. On device="meta" only shapes exist; an engine materializes its shard.

    gpt: preset=<GPT_PRESETS key> and any GPTConfig field as override.
    resnet: blocks=(2,2,2), width=16, num_classes=10.  mlp: sizes=(7,15,3).
    """
    with torch.device(device):
        if name == "gpt":
            preset = kw.pop("preset", "gpt-tiny")
            base = GPT_PRESETS[preset]
            fields = {k: v for k, v in kw.items() if v is not None}
            cfg = GPTConfig(**{**base.__dict__, **fields})
            return GPT(cfg, seed=seed)
        if name == "resnet":
            return ResNet(blocks=tuple(kw.get("blocks", (2, 2, 2))), width=kw.get("width", 16),
                          num_classes=kw.get("num_classes", 10), seed=seed)
        if name == "mlp":
            return MLPModel(sizes=tuple(kw.get("sizes", (7, 15, 3))), seed=seed)
    raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}")


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The default wrap units below the root: every child of an nn.ModuleList of blocks
    (GPT blocks, MLP layers) and every ResNet stage, in forward order."""
    units: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            units.extend(module.children())
    return units


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
